"""One rank of a share_on_node scenario, started by tests/distributed/test_multinode.py (one
process per rank, gloo on loopback, env:// rendezvous):

    python -m tests.support.multinode_share SCENARIO RANK WORLD OUT_DIR [TAG]

Each rank writes OUT_DIR/<rank>.json: whether it built the array, what it holds,
the warnings it got, or the error it raised (type and message)."""
import functools
import json
import os
import sys
import time
import warnings
from datetime import timedelta

import torch.distributed as dist

import fastloader.distributed as fd
from fastloader import PackedStringArray

N = 2000
BUILT = []


def build(tag="job", strategy="file_descriptor"):
    BUILT.append(os.getpid())
    return PackedStringArray((f"{tag}/item_{i:06d}" for i in range(N)),
                             sharing_strategy=strategy)


def other_build():
    return build("other")


def builder_exits():
    report({"rank": ARGS["rank"], "died": True})
    os._exit(7)   # dies inside build(), before publishing anything


def report(result):
    path = os.path.join(ARGS["out_dir"], f"{ARGS['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(path + ".tmp", path)


ARGS = {}
TWO_NODES = {0: "node-x", 1: "node-y", 2: "node-y"}   # rank 1 builds for itself and 2


def builder_raises():
    raise ValueError("no index today")


def builder_returns_a_list():
    return [f"job/item_{i:06d}" for i in range(N)]


def summary(arr):
    return {"len": len(arr), "first": arr[0], "last": arr[len(arr) - 1],
            "strategy": arr.sharing_strategy, "chars": sum(len(s) for s in arr)}


def run(scenario, rank, world, out_dir, tag):
    result = {"rank": rank, "pid": os.getpid()}
    if scenario == "subgroup":
        # two subgroups of 2 in a job of 4: each builds once for its own members
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        result["array"] = summary(fd.share_on_node(build, group=groups[rank // 2]))
    elif scenario == "not_member":
        group = dist.new_group([0, 1])
        result["array"] = summary(fd.share_on_node(build, group=group))
    elif scenario == "pidns":
        result["array"] = summary(fd.share_on_node(build))
    elif scenario == "pidns_same_key":
        # pretend to be one node although rank 1 has its own PID namespace and
        # /proc: attaching must fail, and the rank must build instead
        fd.node_key = lambda: "one-node-by-fiat"
        result["array"] = summary(fd.share_on_node(build))
    elif scenario == "pidns_same_key_copy_fails":
        fd.node_key = lambda: "one-node-by-fiat"
        result["array"] = summary(fd.share_on_node(build if rank == 0 else builder_raises,
                                                   key="index"))
    elif scenario in ("two_nodes_builder_dies", "two_nodes_builder_raises"):
        fd.node_key = lambda: TWO_NODES[rank]
        broken = builder_exits if scenario.endswith("dies") else builder_raises
        result["array"] = summary(fd.share_on_node(broken if rank == 1 else build,
                                                   key="index"))
    elif scenario == "missing_default":   # no timeout: the process group's ends it
        if rank == world - 1:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not os.path.exists(
                    os.path.join(out_dir, "0.json")):
                time.sleep(0.2)
            result["skipped_the_call"] = True
        else:
            result["array"] = summary(fd.share_on_node(build))
    elif scenario == "different_builders":
        result["array"] = summary(fd.share_on_node(build if rank == 0 else other_build))
    elif scenario == "different_partial_args":
        # one function, different bound arguments: different data, so an error
        split = "train" if rank == 0 else "val"
        result["array"] = summary(fd.share_on_node(functools.partial(build, split)))
    elif scenario == "same_partial_args":
        result["array"] = summary(fd.share_on_node(functools.partial(build, tag=tag)))
    elif scenario == "missing":
        if rank == world - 1:   # never calls it; leaves once the others are done
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not os.path.exists(
                    os.path.join(out_dir, "0.json")):
                time.sleep(0.2)
            result["skipped_the_call"] = True
        else:
            result["array"] = summary(fd.share_on_node(build, timeout=8))
    elif scenario == "builder_dies":
        result["array"] = summary(fd.share_on_node(builder_exits if rank == 0 else build,
                                                   key="index"))
    elif scenario == "builder_raises":
        result["array"] = summary(fd.share_on_node(builder_raises if rank == 0 else build,
                                                   key="index"))
    elif scenario == "not_packed":
        result["array"] = summary(fd.share_on_node(
            builder_returns_a_list if rank == 0 else build, key="index"))
    elif scenario == "stale":
        # job TAG on named segments; a job killed after publishing is run first
        arr = fd.share_on_node(functools.partial(build, tag, "file_system"))
        result["array"] = summary(arr)
        dist.barrier()
        if tag == "killed":
            with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
                json.dump(dict(result, built=bool(BUILT)), f)
            os.kill(os.getpid(), 9)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    return result


def main(scenario, rank, world, out_dir, tag="job"):
    rank, world = int(rank), int(world)
    ARGS.update(rank=rank, out_dir=out_dir)
    pg_timeout = 15 if scenario == "missing_default" else 40
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout))
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = run(scenario, rank, world, out_dir, tag)
        except Exception as exc:   # noqa: BLE001 -- the test inspects type and text
            result = {"rank": rank, "error_type": type(exc).__name__, "error": str(exc)}
    result.update(built=bool(BUILT), seconds=time.monotonic() - t0,
                  warnings=[str(w.message) for w in caught])
    report(result)
    if rank == 0:   # it hosts the store: stay until the others have reported
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(out_dir, f"{r}.json")) for r in range(world)):
            time.sleep(0.1)
    # no destroy_process_group: after an error some peers are gone or never came
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
