"""pandas: a 1M-row DataFrame dataset (with str columns) gives torch's batches under
every start method."""
import pytest

from tests.clients.conftest import assert_fastloader_ran, run_both


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataframe_batches_equal_torch(out_dir, method):
    ref, got = run_both("pandas_client.py", out_dir, method)
    # the frame really holds both kinds of string column
    assert ref["dtypes"]["tag"] == "object" and ref["dtypes"]["name"] != "object", ref["dtypes"]
    first = ref["batches"][0]
    assert isinstance(first["name"], list) and isinstance(first["name"][0], str)
    assert len(ref["batches"]) == 24
    assert got["loader"]["multiprocessing_context"] == method
    assert_fastloader_ran(got["loader"], workers=2)
    assert ref["loader"]["stats"] is None
