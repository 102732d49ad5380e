"""HF `datasets`: a CSV that this script writes, loaded with load_dataset("csv"),
tokenised with .map, formatted for torch, batched with a padding collate_fn, and a
tiny model trained on it. Usage: LOADER OUT KIND START_METHOD, KIND being "map"
(the arrow-backed Dataset) or "iterable" (to_iterable_dataset with 4 shards).

No network: the caller sets HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1; every cache
is under the output's folder."""
import csv
import os
import random

import torch
from torch import nn

from tests.clients.client_common import clone_batch, loader_facts, parse_argv, save

ROWS = 96
WORKERS = 2
SHARDS = 4


def write_csv(path):
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["text", "label", "score"])
        for _ in range(ROWS):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
            out.writerow([text, rng.randint(0, 2), round(rng.uniform(-1, 1), 6)])


def tokenize(row):
    return {"input_ids": list(row["text"].encode())}


def pad_collate(rows):
    """Right-pad input_ids to the longest row of the batch, with a mask."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = r["input_ids"]
        mask[i, :len(r["input_ids"])] = True
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.stack([r["label"] for r in rows]),
            "score": torch.stack([r["score"] for r in rows])}


class BagClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.head = nn.Linear(17, 3)

    def forward(self, ids, mask, score):
        summed = (self.embed(ids) * mask.unsqueeze(-1)).sum(1)
        mean = summed / mask.sum(1, keepdim=True)
        return self.head(torch.cat([mean, score.unsqueeze(1).float()], 1))


def main():
    DataLoader, out, (kind, method) = parse_argv()
    import datasets   # after parse_argv: the import is the slow part of start-up

    assert datasets.config.HF_DATASETS_OFFLINE, "the test must run offline"
    work = os.path.dirname(os.path.abspath(out))
    data = os.path.join(work, "data.csv")
    if not os.path.exists(data):
        write_csv(data + ".tmp")
        os.replace(data + ".tmp", data)
    table = datasets.load_dataset("csv", data_files=data, split="train",
                                  cache_dir=os.path.join(work, "cache"))
    table = table.map(tokenize, remove_columns=["text"])
    columns = ["input_ids", "label", "score"]
    generator = torch.Generator().manual_seed(7)
    if kind == "map":
        dataset = table.with_format("torch", columns=columns)
        loader = DataLoader(dataset, batch_size=8, shuffle=True, generator=generator,
                            collate_fn=pad_collate, num_workers=WORKERS,
                            multiprocessing_context=method)
    else:
        dataset = table.to_iterable_dataset(num_shards=SHARDS).shuffle(seed=3, buffer_size=8)
        dataset = dataset.with_format("torch")
        loader = DataLoader(dataset, batch_size=8, collate_fn=pad_collate,
                            num_workers=WORKERS, multiprocessing_context=method)

    torch.manual_seed(0)
    model = BagClassifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches, losses = [], []
    for epoch in range(2):
        if kind == "iterable":
            dataset.set_epoch(epoch)
        for batch in loader:
            batches.append(clone_batch(batch))
            logits = model(batch["input_ids"], batch["attention_mask"], batch["score"])
            loss = nn.functional.cross_entropy(logits, batch["labels"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach().clone())
    save(out, batches=batches, losses=losses, loader=loader_facts(loader),
         dataset_type=f"{type(dataset).__module__}.{type(dataset).__name__}",
         n_shards=getattr(dataset, "num_shards", None))


if __name__ == "__main__":
    main()
