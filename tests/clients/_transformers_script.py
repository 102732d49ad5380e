"""HF transformers client: ``python _transformers_script.py MODE OUT``.

Trains a tiny GPT-2 built from a config (2 layers, vocabulary 100; nothing is
downloaded) with ``Trainer`` and ``dataloader_num_workers=2``. The Trainer builds
torch's DataLoader itself; MODE ``fastloader`` calls fastloader.install() first,
MODE ``torch`` does not. Saves every batch the model was given, every loss and the
final weights."""
import os
import sys

import torch

from tests.clients._dropin_common import Tokens, dump_stacks_on_sigusr1, setup_determinism

STEPS, WORKERS = 8, 2


def main():
    mode, out = sys.argv[1:3]
    dump_stacks_on_sigusr1()
    if mode == "fastloader":
        import fastloader

        fastloader.install()
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    setup_determinism(0)
    batches, losses = [], []

    class RecordingTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            batches.append({k: v.detach().clone() for k, v in inputs.items()})
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            plain = loss[0] if isinstance(loss, tuple) else loss
            losses.append(plain.detach().clone())
            return loss

    config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=os.path.join(out, "trainer"), per_device_train_batch_size=4,
        max_steps=STEPS, dataloader_num_workers=WORKERS, use_cpu=True, report_to=[],
        seed=0, data_seed=0, logging_steps=1, save_strategy="no", disable_tqdm=True,
        learning_rate=1e-3)
    trainer = RecordingTrainer(model=model, args=args,
                               train_dataset=Tokens(24, 16, os.path.join(out, "markers")))
    trainer.train()
    torch.save({"batches": batches, "losses": losses,
                "weights": [p.detach().clone() for p in model.parameters()],
                "logged": [e["loss"] for e in trainer.state.log_history if "loss" in e],
                "main_pid": os.getpid()}, os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main()
