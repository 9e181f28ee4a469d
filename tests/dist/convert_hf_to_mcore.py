"""torchrun worker: `qarl-convert hf-to-mcore --tp 2 --ep 2` writing a sharded checkpoint directly.

argv: HF_DIR OUT_DIR TP EP [PP]. Every rank runs the CLI entry; rank 0 reports the marker's world size.
"""
import json
import sys
from pathlib import Path

import torch.distributed as dist

from conversion.cli import main
from megatron_qarl.checkpointing.format import MARKER_NAME
from _common import write_result


if __name__ == "__main__":  # megatron's checkpoint writer starts processes that re-import this module
    hf_dir, out, tp, ep = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    pp = sys.argv[5] if len(sys.argv) > 5 else "1"
    rc = main(["hf-to-mcore", "--hf", hf_dir, "--out", out, "--tp", tp, "--ep", ep, "--pp", pp])
    assert rc == 0, rc
    marker = json.loads((Path(out) / MARKER_NAME).read_text())
    write_result({"world_size": dist.get_world_size(), "marker_world_size": marker["world_size"],
                  "distcp_files": len(list(Path(out).glob("*.distcp")))})
