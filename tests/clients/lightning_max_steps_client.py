"""PyTorch Lightning with `max_steps`: it saves the loader's state in every
checkpoint and loads it from every one, also from a checkpoint taken when the
epoch's last batch was trained but the loader had not yet been asked for another
(so it has not ended). Usage: LOADER OUT RESUME_BATCH_SIZE. Trains 4 steps (one
epoch of 16 samples in batches of 4), a checkpoint at step 4; resumes from it to
step 6 with RESUME_BATCH_SIZE; and trains 6 steps uninterrupted. Saves the steps
of both runs."""
import os

from tests.clients.client_common import parse_argv, save

DataLoader, OUT, (RESUME_BATCH_SIZE,) = parse_argv()
ROOT = OUT + ".lightning"   # this run's checkpoints, apart from the other loader's

import lightning as L  # noqa: E402  (after the loader's import, as a user's script)
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from tests.clients.lightning_steps import StepRecorder  # noqa: E402


StepRecorder.loader_class = DataLoader


def fit(model, max_steps, root, ckpt_path=None):
    L.seed_everything(0, verbose=False)
    every = ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_top_k=-1,
                            filename="{step}")
    L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=root,
              callbacks=[every]).fit(model, ckpt_path=ckpt_path)
    return model.steps


full = fit(StepRecorder(), 6, ROOT + ".full")
fit(StepRecorder(), 4, ROOT)
resumed = fit(StepRecorder(batch_size=int(RESUME_BATCH_SIZE)), 6, ROOT,
              os.path.join(ROOT, "step=4.ckpt"))
save(OUT, full_steps=full, resumed_steps=resumed)
