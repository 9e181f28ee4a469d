"""RL core, pure torch (no megatron): objectives (``losses``: TBPO + baselines, ``get_loss(name)``),
per-call metrics and their reduction (``metrics``), group-normalised advantages (``advantages``),
verifiable rewards (``rewards``: math-verify in killable workers, exact match), prompt data (``data``),
the synthetic arithmetic task (``synthetic``). The tokenizer a run uses is ``megatron_qarl.tokenizer``.

Submodules are imported explicitly (``from megatron_qarl.rl.losses import tbpo_loss``) so importing the
package stays cheap.
"""
