"""qarl-train whose embedded engine mishandles one refit (a fault-injection test helper for the refit canary).

    python tests/dist/plant_refit_fault.py FAULT N <qarl-train arguments...>

At the N-th publish (0: the one before the first rollout; k: the one after step k's update) the engine:

* ``skip-bucket``:  drops the second bucket it is sent (a refit that lost a bucket on the way);
* ``skip-layer``:   drops every tensor of layer 1 (a refit that skipped a layer);
  both also on the vLLM engine's trainer side, before its pipe;
* ``skip-derived``: takes every tensor but does not re-derive the weights it computes with from the codes it
  holds (a stale derived tensor: what vLLM's reload RFCs describe);
* ``stale-restore``: takes the publish, then has its weights restored from the copy it held after publish 0
  (a publish that lands on an engine restored from a stale copy);
* ``no-quant-switch`` (N ignored): the engine process starts without the run's quantization settings (an
  environment switch that never reached the workers), so it would serve the published codes as bf16.

Its checksums of what it holds are those of what it was sent, so publish.verify cannot tell (the cases a
checksum does see are tests/test_publish.py's). Only this helper patches the engine; the trainer runs unchanged.
"""
import sys

FAULTS = ("skip-bucket", "skip-layer", "skip-derived", "stale-restore", "no-quant-switch")


def main() -> None:
    fault, at = sys.argv[1], int(sys.argv[2])
    if fault not in FAULTS:
        raise SystemExit(f"unknown fault {fault!r}; one of {FAULTS}")
    from megatron_qarl.rollout.embedded import EmbeddedEngine
    from megatron_qarl.rollout.vllm_engine import VLLMEngine

    end, derive = EmbeddedEngine.end_weight_update, EmbeddedEngine._dequantize_into_model
    state = {"publish": -1, "buckets": 0, "first": None}

    def planted(self) -> bool:
        return state["publish"] == at

    def plant_in_publish(engine_class) -> None:
        """Count `engine_class`'s publishes and buckets; at publish `at`, lose a bucket or layer 1 on the way in."""
        begin, update = engine_class.begin_weight_update, engine_class.update_weights

        def counting_begin(self):
            state["publish"] += 1
            state["buckets"] = 0
            return begin(self)

        def faulty_update(self, named_tensors):
            state["buckets"] += 1
            if planted(self) and fault == "skip-bucket" and state["buckets"] == 2:
                print(f"[plant_refit_fault] publish {at}: bucket 2 dropped", flush=True)
                return None
            if planted(self) and fault == "skip-layer":
                named_tensors = [(n, t) for n, t in _items(named_tensors) if ".layers.1." not in n]
            return update(self, named_tensors)

        engine_class.begin_weight_update, engine_class.update_weights = counting_begin, faulty_update

    def faulty_derive(self, prefix, kind):
        if planted(self) and fault == "skip-derived":
            return None
        return derive(self, prefix, kind)

    def faulty_end(self):
        result = end(self)
        if state["publish"] == 0:
            state["first"] = {k: v.clone() for k, v in self.model.state_dict().items()}
        if planted(self):
            print(f"[plant_refit_fault] publish {at}: {fault}", flush=True)
            if fault == "stale-restore":
                self.model.load_state_dict(state["first"])
        return result

    if fault == "no-quant-switch":
        import dataclasses

        from megatron_qarl.rollout.embedded import EmbeddedKind

        config_from_run = EmbeddedKind.config_from_run
        EmbeddedKind.config_from_run = lambda self, *a, **kw: dataclasses.replace(config_from_run(self, *a, **kw),
                                                                                  quantization_config=None)
    plant_in_publish(EmbeddedEngine)
    plant_in_publish(VLLMEngine)  # its trainer side: what is lost never reaches vLLM's pipe
    EmbeddedEngine.end_weight_update, EmbeddedEngine._dequantize_into_model = faulty_end, faulty_derive
    from megatron_qarl.cli import train_main

    sys.exit(train_main(sys.argv[3:]))


def _items(named_tensors):
    """(name, tensor) pairs of a FlattenedBucket or of a list of pairs."""
    if hasattr(named_tensors, "flattened_tensor") and hasattr(named_tensors, "metadata"):
        from megatron_qarl.rollout.payload import unflatten_bucket

        return list(unflatten_bucket(named_tensors))
    return list(named_tensors)


if __name__ == "__main__":
    main()
