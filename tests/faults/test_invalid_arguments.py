"""Arguments a loader refuses up front, with an error that lists the valid values.
"""
import pytest

from fastloader import DataLoader
from tests.support import datasets as ds
from tests.support.fault_helpers import QUIET_WORKER_COUNT_WARNING

pytestmark = [QUIET_WORKER_COUNT_WARNING]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("value", ["bogus", "", "FILE_SYSTEM", "file_descriptor ", "filesystem"])
def test_invalid_sharing_strategy_rejected(value, num_workers):
    with pytest.raises(ValueError) as info:
        DataLoader(ds.TensorLabelDataset(), batch_size=2, num_workers=num_workers,
                   sharing_strategy=value)
    message = str(info.value)
    assert "file_descriptor" in message and "file_system" in message, message
