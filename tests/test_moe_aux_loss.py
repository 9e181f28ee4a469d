"""train.moe_aux_loss_coeff: the MoE load-balancing loss in RL updates. Off by default (slime / miles run
Qwen3-30B-A3B RL with --moe-aux-loss-coeff 0); null keeps the model config's coefficient; a value > 0 is what
megatron's routers add. Checked on the gradient itself: with the policy loss multiplied by zero, only the
balance loss can reach the routers' weights."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from aligned_common import mcore_logits, tokens  # noqa: E402

from megatron_qarl.config import ConfigError, load_config  # noqa: E402
from megatron_qarl.models.registry import family_named  # noqa: E402
from megatron_qarl.parallel import ParallelLayout  # noqa: E402
from megatron_qarl.run_context import learner_config_overrides  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    """Single-process megatron world (conftest.world_of_one)."""


def test_the_key_reaches_the_learners_megatron_config():
    assert learner_config_overrides(load_config(None, []))["moe_aux_loss_coeff"] == 0.0
    assert "moe_aux_loss_coeff" not in learner_config_overrides(load_config(None, ["train.moe_aux_loss_coeff=null"]))
    assert learner_config_overrides(load_config(None, ["train.moe_aux_loss_coeff=0.01"]))["moe_aux_loss_coeff"] == 0.01
    with pytest.raises(ConfigError, match=r"train.moe_aux_loss_coeff=-0.1 must be >= 0"):
        load_config(None, ["train.moe_aux_loss_coeff=-0.1"])


TINY = {"qwen3_moe": "tiny", "deepseek_v3": "tiny-deepseek-v3"}


def _router_grad_norm(family_name: str, cfg_overrides: list[str]) -> float:
    """Router weight gradient of a zero policy loss on a freshly built training-mode model, with the run's
    learner overrides: nonzero only if a balance loss is attached to the routing probabilities."""
    family = family_named(family_name)
    hf_config = family.config_from_preset(TINY[family_name])
    torch.manual_seed(0)
    model = family.build_model(hf_config, ParallelLayout(),
                               config_overrides=learner_config_overrides(load_config(None, cfg_overrides)))
    model.train()
    (0.0 * mcore_logits(model, tokens(hf_config.vocab_size)).sum()).backward()
    routers = [p.grad for n, p in model.named_parameters() if n.endswith("router.weight")]
    assert routers and all(g is not None for g in routers)
    return float(torch.stack([g.norm() for g in routers]).norm())


def test_qwen3_moe_routers_get_a_balance_gradient_only_when_asked():
    assert _router_grad_norm("qwen3_moe", []) == 0.0  # the default: off
    assert _router_grad_norm("qwen3_moe", ["train.moe_aux_loss_coeff=null"]) > 0  # the model's 0.001
    assert _router_grad_norm("qwen3_moe", ["train.moe_aux_loss_coeff=0.01"]) > 0


def test_deepseek_v3_routers_get_its_sequence_wise_balance_loss_when_asked():
    # the family is aux-loss-free (expert bias) by default; a coefficient turns on its seq_aux_loss
    assert _router_grad_norm("deepseek_v3", []) == 0.0
    assert _router_grad_norm("deepseek_v3", ["train.moe_aux_loss_coeff=null"]) == 0.0
    assert _router_grad_norm("deepseek_v3", ["train.moe_aux_loss_coeff=0.01"]) > 0
