"""qarl-train that SIGKILLs itself in the middle of a weight publish (a fault-injection test helper).

    python tests/dist/kill_in_publish.py N <qarl-train arguments...>

The N-th publish (0: the one before the first rollout; k: the one after step k-1's update) is killed after
its first bucket reached the embedded engine and before the engine's update ended: the engine holds a mix
of old and new weights and the process dies with no cleanup, as under the OOM killer or `kill -9`. Only this
test helper patches the engine; the trainer runs unchanged.
"""
import os
import signal
import sys


def main() -> None:
    kill_at = int(sys.argv[1])
    from megatron_qarl.rollout.embedded import EmbeddedEngine

    begin, update = EmbeddedEngine.begin_weight_update, EmbeddedEngine.update_weights
    count = {"publish": -1}

    def counting_begin(self):
        count["publish"] += 1
        return begin(self)

    def killing_update(self, named_tensors):
        result = update(self, named_tensors)
        if count["publish"] == kill_at:
            print(f"[kill_in_publish] SIGKILL in publish {kill_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    EmbeddedEngine.begin_weight_update, EmbeddedEngine.update_weights = counting_begin, killing_update
    from megatron_qarl.cli import train_main

    sys.exit(train_main(sys.argv[2:]))


if __name__ == "__main__":
    main()
