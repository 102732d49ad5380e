"""The per-batch work of the peer loaders: fetch a batch of indices, then collate.

torchdata.nodes and SPDL do not batch by themselves the way torch's DataLoader
does; their documentation has the pipeline take a batch of indices from a batch
sampler and run one function that fetches the samples and collates them. This is
that function, shared by every peer so that they do the same work per batch as
the DataLoaders. A class at module level (not a closure) so process workers can
unpickle it under any start method.
"""

from torch.utils.data import BatchSampler, SequentialSampler, default_collate


class FetchAndCollate:
    """``indices -> collate_fn(samples)``, through ``__getitems__`` when the dataset
    has it (as torch's fetcher does), else one ``__getitem__`` per index."""

    def __init__(self, dataset, collate_fn=None):
        self.dataset = dataset
        self.collate_fn = collate_fn if collate_fn is not None else default_collate

    def __call__(self, indices):
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        return self.collate_fn(samples)


def batch_sampler(dataset, batch_size):
    """The batches of indices torch's DataLoader draws with shuffle=False, drop_last=False."""
    return BatchSampler(SequentialSampler(dataset), batch_size, drop_last=False)
