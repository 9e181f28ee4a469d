"""torchrun worker: a short SFT run at the layout given as `tp,ep`, checkpoint to argv[2]."""
import sys

from _common import write_result

from megatron_qarl.config import RunConfig, SFTConfig
from megatron_qarl.parallel import ParallelLayout
from megatron_qarl.sft import run_sft


def short_sft(out: str) -> SFTConfig:
    # Shared with tests/test_sft.py's world-1 reference run.
    return SFTConfig(steps=5, batch_size=8, lr_warmup_steps=0, log_every=1, eval_every=0, eval_prompts=8,
                     eval_max_new_tokens=4, out_checkpoint=out)


def main():
    tp, ep = (int(x) for x in sys.argv[1].split(","))
    cfg = RunConfig()
    cfg.model.tokenizer = "char"
    cfg.parallel = ParallelLayout(tp=tp, ep=ep)
    result = run_sft(cfg, short_sft(sys.argv[2]))
    write_result({"loss_history": result["loss_history"], "greedy": result["eval/greedy_accuracy"],
                  "sampled": result["eval/sampled_accuracy"]})


if __name__ == "__main__":
    main()
