"""HF datasets: load_dataset("csv") + map + with_format("torch") + a padding collate_fn,
map-style and to_iterable_dataset(), under fork and spawn; batches and the losses of a
tiny model equal torch's."""
import os

import pytest

from tests.clients.conftest import assert_fastloader_ran, run_both

pytest.importorskip("datasets", reason="HF datasets is not installed "
                    "(make test installs requirements-clients.txt)")

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_csv_dataset_trains_as_with_torch(out_dir, kind, method):
    env = dict(OFFLINE, HF_HOME=os.path.join(out_dir, "hf-home"))
    ref, got = run_both("datasets_client.py", out_dir, kind, method, env=env)
    # 2 epochs of 96 rows in batches of 8, padded to each batch's longest row
    assert len(ref["batches"]) == 24 and len(ref["losses"]) == 24
    widths = {b["input_ids"].shape[1] for b in ref["batches"]}
    assert len(widths) > 1, f"the padding collate never padded: widths {widths}"
    if kind == "iterable":
        assert ref["dataset_type"] == "datasets.iterable_dataset.IterableDataset"
        assert ref["n_shards"] == 4
    else:
        assert ref["dataset_type"] == "datasets.arrow_dataset.Dataset"
    assert got["loader"]["multiprocessing_context"] == method
    assert_fastloader_ran(got["loader"], workers=2)
