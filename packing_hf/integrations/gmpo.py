"""``packing_hf.GMPOTrainer``: TRL's experimental GMPO (Geometric-Mean Policy Optimization) on packed rollouts.

``trl.experimental.gmpo.GMPOTrainer`` is ``trl.GRPOTrainer`` with another ``_compute_loss``: each
rollout's weight is the geometric mean of its token importance ratios, clipped in log space
(``exp(mean over the completion mask of the clipped log-ratios)``), times its advantage; the optional KL
term is averaged per sequence; the loss is the plain mean over sequences. Everything that loss reads from
the model comes from ``_get_per_token_logps_and_entropies`` (the policy log-probs and entropies, and, in
TRL's ``_prepare_inputs``, the old-policy and reference log-probs), which
:class:`~packing_hf.integrations.rl.PackedRolloutsMixin` computes on packed rows with the same values on
every completion token. Every reduction in the loss and its metrics (the geometric mean, the KL average,
the entropy and clip-ratio means) is masked by ``completion_mask`` (times ``tool_mask``), so the zeros the
packed forward writes where the padded one computes padding tokens never enter them.

``share_prompt=True`` is exact here too: the loss is a function of the per-token log-probs of the
completions, which a shared prefix leaves unchanged, and the prompt's gradient is the sum over its branches,
as over ``G`` copies. Same options, refusals and ``packing_stats`` as :class:`~packing_hf.GRPOTrainer`.

Importing this module imports ``trl.experimental``, which emits TRL's ``TRLExperimentalWarning`` (silenced
by ``TRL_EXPERIMENTAL_SILENCE=1``).

>>> GMPOConfig("out", report_to="none", use_cpu=True, share_prompt=True).epsilon  # GMPO's log-space clip
0.4
"""

from __future__ import annotations

from dataclasses import dataclass

from trl.experimental.gmpo import GMPOConfig as _StockGMPOConfig
from trl.experimental.gmpo import GMPOTrainer as _StockGMPOTrainer

from .rl import PackedRolloutsMixin, RolloutPackingArguments

__all__ = ["GMPOConfig", "GMPOTrainer"]


@dataclass
class GMPOConfig(RolloutPackingArguments, _StockGMPOConfig):
    """``trl.experimental.gmpo.GMPOConfig`` plus :class:`~packing_hf.integrations.rl.RolloutPackingArguments`
    (``max_tokens_per_batch``, ``share_prompt``, ``packing_preflight``).

    >>> GMPOConfig(output_dir="out", max_tokens_per_batch=1024, report_to="none", use_cpu=True).max_tokens_per_batch
    1024
    """


class GMPOTrainer(PackedRolloutsMixin, _StockGMPOTrainer):
    """``trl.experimental.gmpo.GMPOTrainer`` scoring packed rollouts: same log-probs, loss, gradients, metrics.

    Same arguments as the TRL trainer; ``args`` is converted to :class:`GMPOConfig` if it is a plain
    ``TrainingArguments`` / TRL config (its values kept, ``epsilon`` included). Generation, rewards and
    GMPO's loss are TRL's; only the log-prob forwards run on packed rows (see the module docstring).

    >>> GMPOTrainer.__mro__[1].__name__, GMPOTrainer.stock
    ('PackedRolloutsMixin', 'trl.experimental.gmpo.GMPOTrainer')
    """

    algorithm = "GMPO"
    config_class = GMPOConfig
    stock = "trl.experimental.gmpo.GMPOTrainer"
