"""torchvision: ImageFolder + RandomResizedCrop under torch's DataLoader, and the same
transform over fastloader.PackedImageFolder under fastloader's. Usage: LOADER OUT ROOT
START_METHOD. Records the index (classes, class_to_idx, samples, targets) and two
shuffled epochs of batches (persistent workers)."""
import torch
from torchvision import transforms
from torchvision.datasets import ImageFolder

from tests.clients.client_common import collect, loader_facts, parse_argv, save


def main():
    DataLoader, out, (root, method) = parse_argv()
    transform = transforms.Compose([
        transforms.RandomResizedCrop(16, scale=(0.3, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.PILToTensor(),
    ])
    if DataLoader.__module__.startswith("fastloader"):
        from fastloader import PackedImageFolder

        dataset = PackedImageFolder(root, transform=transform)
        order = [(dataset.path(i), dataset.target(i)) for i in range(len(dataset))]
    else:
        dataset = ImageFolder(root, transform=transform)
        order = list(dataset.samples)
    index = {
        "classes": list(dataset.classes),
        "class_to_idx": dict(dataset.class_to_idx),
        # what the dataset yields, in order: (full path, class index)
        "order": order,
        # the attributes (missing ones recorded as such)
        "samples": list(dataset.samples) if hasattr(dataset, "samples") else "<missing>",
        "targets": [int(t) for t in dataset.targets],
        "targets_type": type(dataset.targets).__name__,
    }
    torch.manual_seed(5)
    loader = DataLoader(dataset, batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(11), num_workers=2,
                        persistent_workers=True,
                        multiprocessing_context=method)
    batches = collect(loader, epochs=2)
    save(out, batches=batches, index=index, loader=loader_facts(loader))


if __name__ == "__main__":
    main()
