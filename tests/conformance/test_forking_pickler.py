"""Objects in a batch that travel pickled arrive as torch's queue delivers them:
pickled with ForkingPickler's protocol and its registered reducers (a user's
ForkingPickler.register() was ignored, the protocol was 5 where torch's is 4, and
arrays pickled in band arrived read-only or in their foreign byte order)."""
import pytest
import torch

from fastloader import DataLoader
from tests.support import forking_datasets as fd
from tests.support.helpers import collect


def _described(batch):
    return {
        "handle": batch["handle"].v,
        "protocol": batch["protocol"].protocol,
        "big_endian": (batch["big_endian"].dtype.str, batch["big_endian"].tolist(),
                       batch["big_endian"].flags.writeable),
        "read_only_str": (batch["read_only_str"].tolist(),
                          batch["read_only_str"].flags.writeable),
        "read_only_struct": (batch["read_only_struct"].tolist(),
                             batch["read_only_struct"].flags.writeable),
    }


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_pickled_parts_of_a_batch_arrive_as_torchs_queue_delivers_them(context):
    got = {}
    for cls in (torch.utils.data.DataLoader, DataLoader):
        loader = cls(fd.Indices(), batch_size=2, num_workers=2, collate_fn=fd.pickled_parts,
                     multiprocessing_context=context)
        got[cls] = [_described(b) for b in collect(loader, seconds=120)]
    theirs, ours = got.values()
    assert theirs[0]["handle"] == ("rebuilt by the registered reducer", 1)
    assert ours == theirs
