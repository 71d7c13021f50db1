"""RankAdaptiveCallback in a real (tiny, offline) transformers.Trainer run: the hooks sit on the optimizer the
Trainer steps, ranks shrink on the max_steps horizon, the optimizer state keeps the shrunk shapes, and what the
Trainer saves loads back into a freshly tensorized model with the same outputs."""

from __future__ import annotations

import math

import accelerate  # noqa: F401  (transformers' Trainer needs it; the test extra installs both)
import pytest
import torch
import transformers

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.integrations.huggingface import RankAdaptiveCallback, unwrap_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = dict(n_layer=1, n_embd=64, n_head=2, vocab_size=256, n_positions=32, bos_token_id=0, eos_token_id=0)
TT = TensorizeConfig(max_rank=8, min_numel=2**12)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16):
        self.ids = torch.randint(0, CONFIG["vocab_size"], (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, k):
        return {"input_ids": self.ids[k], "labels": self.ids[k]}


def tensorized_gpt2(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    comera_fx.tensorize_(model, TT, example_inputs={"input_ids": torch.zeros(1, 8, dtype=torch.long)})
    return model


def test_trainer_run_shrinks_ranks_and_saves_a_loadable_model(tmp_path):
    model = tensorized_gpt2(seed=0)
    before = sum(p.numel() for m in model.modules() if isinstance(m, comera_fx.TTMatrix) for p in m.parameters())
    callback = RankAdaptiveCallback(comera_fx.BudgetConfig(keep_fraction=0.4, prunes=3))  # horizon: max_steps
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=30,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[callback])
    trainer.train()

    hook = callback.rank_adaptive
    assert hook.settings.total_steps == 30 and hook.step == 30  # horizon from max_steps; every step hooked
    after = hook.live_tt_params()
    assert after <= 0.5 * before  # shrunk to near the 0.4 target on the 30-step horizon
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(math.isfinite(v) for v in losses)

    # The optimizer the Trainer steps holds exactly the model's (new, shrunk) parameters and state of their shapes;
    # the scheduler still drives that optimizer's groups.
    inner = unwrap_optimizer(trainer.optimizer)
    held = {id(p) for group in inner.param_groups for p in group["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}
    for group in inner.param_groups:
        for p in group["params"]:
            for value in inner.state.get(p, {}).values():
                assert not torch.is_tensor(value) or value.dim() == 0 or value.shape == p.shape
    assert unwrap_optimizer(trainer.lr_scheduler.optimizer) is inner

    trainer.save_model(str(tmp_path / "final"))
    saved = list((tmp_path / "final").glob("*.safetensors")) + list((tmp_path / "final").glob("*.bin"))
    assert saved
    fresh = tensorized_gpt2(seed=1)  # other weights, the original ranks: loading adopts the pruned shapes
    state = _load_state(saved[0])
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("lm_head.tt.") for k in missing)  # the tied head's aliases
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(4))
    model.eval(), fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_run_the_hook_sees_as_compiled_ends_stored_at_its_live_ranks(tmp_path):
    """A compiled run rounds in place and may hold the cores wider than the live ranks to its end (on the CPU at
    ranks <= 16 it keeps them through the last prune point). The callback stores the live ranks when training ends,
    so the checkpoint the Trainer saves is the pruned size: counted from the tensors, against the gates' live
    ranks."""
    from comera_fx.runtime.compiled import mark_compiled

    model = tensorized_gpt2(seed=0)
    mark_compiled(model)  # as a compiled run: prunes round in place (the steps themselves run eagerly here)
    callback = RankAdaptiveCallback(comera_fx.BudgetConfig(keep_fraction=0.4, prunes=3))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    matrices = [m for m in model.modules() if isinstance(m, comera_fx.TTMatrix)]
    held_wider = []
    callback.on_step_end = lambda *a, **k: held_wider.append(any(m.live_internal_ranks for m in matrices))
    transformers.Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[callback]).train()
    hook = callback.rank_adaptive
    assert any(held_wider)  # the run did hold the cores wider (as compiled; shrink_eagerly ended that)
    assert all(m.live_internal_ranks is None for m in matrices)
    stored = sum(p.numel() for m in set(matrices) for p in m.parameters())
    live = 0
    for m in set(matrices):
        ranks = [int((g.detach() != 0).sum()) for g in m.gates]  # the live ranks, read from the gates
        assert tuple(m.layout.internal_ranks) == tuple(ranks)
        live += sum(c.numel() for c in m.cores) + sum(ranks)  # stored cores at the live ranks, one gate entry each
    assert stored == live < hook.initial_tt_params


def _load_state(path):
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)


def test_callback_takes_the_config_rank_adaptive_takes():
    with pytest.raises(TypeError, match=r"takes a BudgetConfig or a CoMERAConfig.*BudgetConfig\(keep_fraction=0.4, "):
        RankAdaptiveCallback({"keep_fraction": 0.4})
    with pytest.raises(TypeError, match="keep_fraction"):  # the keywords before the configs are gone
        RankAdaptiveCallback(keep_fraction=0.4)
    callback = RankAdaptiveCallback(comera_fx.BudgetConfig(keep_fraction=0.4), history_every=2)
    assert callback.config.total_steps is None and callback.hook_options == {"clock": None, "history_every": 2}
