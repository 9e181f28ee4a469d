"""The catalogue of faults and bad inputs and what each gets: docs/reliability.md is generated from CASES.

    python tests/reliability_catalogue.py           rewrite docs/reliability.md
    python tests/reliability_catalogue.py --check   exit 1 if it is stale

tests/test_reliability_catalogue.py keeps the page in sync and checks that every case names a test that exists,
so every line of the page is something a test injects and asserts (exit status, the one line, no file lost).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"


@dataclass(frozen=True)
class Case:
    area: str
    fault: str  # the fault or bad input, as a user meets it
    injected: str  # how the test makes it happen
    gets: str  # what the user gets
    exit: str  # exit status ("-" where the case is a library call)
    test: str  # tests/<file>.py::<function>


CASES = [
    # ------------------------------------------------------------ a checkpoint from elsewhere is data
    Case("checkpoint trust", "code planted in a dist checkpoint's `.metadata`, completion marker rewritten to match",
         "a pickle whose `__reduce__` runs `touch`; the marker's sha256 recomputed",
         "refused before torch or megatron reads the file, on every path (inspect, mcore-to-hf, export --ckpt, "
         "checkpoint.resume, model.init_checkpoint, sft.init_checkpoint): one line naming `.metadata` and the "
         "global it refers to; nothing runs", "2",
         "test_checkpoint_trust.py::test_planted_metadata_runs_no_code_on_any_path"),
    Case("checkpoint trust", "the same payload with the old marker", "`.metadata` replaced, marker untouched",
         "inspect names the file whose sha256 differs; `resume=auto` warns and resumes the previous checkpoint",
         "2 / 0", "test_checkpoint_trust.py::test_planted_metadata_with_the_old_marker_is_reported_by_inspect_and_"
                  "skipped_by_resume"),
    Case("checkpoint trust", "a planted payload in the newest checkpoint of the run dir being resumed",
         "payload + rewritten marker in step_00000002", "resume=auto refuses the run (a planted file is not damage "
         "to fall back past); the run dir is unchanged", "2",
         "test_checkpoint_trust.py::test_planted_metadata_in_the_newest_run_checkpoint_stops_resume_auto"),
    Case("checkpoint trust", "code planted in a shard's byte entry (a megatron ShardedObject, which torch's load "
         "planner unpickles with weights_only=False)", "a torch.save'd payload appended to a .distcp, `.metadata` "
         "pointed at it, marker rewritten", "refused (weights-only read of every byte entry first)", "2",
         "test_checkpoint_trust.py::test_planted_byte_entry_of_a_shard_runs_no_code"),
    Case("checkpoint trust", "code planted in common.pt while TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 tells torch.load "
         "to unpickle", "payload added to common.pt, marker rewritten", "refused (an explicit weights_only=True "
         "read first)", "2",
         "test_checkpoint_trust.py::test_planted_common_state_runs_no_code_even_when_torch_is_told_to_unpickle"),
    Case("checkpoint trust", "code planted in qarl_extra_state.pt", "a pickle with `__reduce__`",
         "refused by torch's weights-only loader; one line naming the file", "2",
         "test_reliability_checkpoints.py::test_crafted_side_state_runs_no_code_on_inspect_or_resume"),
    Case("checkpoint trust", "any other global in `.metadata` (os.system, subprocess.Popen, eval, torch.load)",
         "protocol-0 GLOBAL opcodes", "CheckpointError: 'refers to <module>.<name>, which torch-DCP metadata never "
         "holds'", "-", "test_checkpoint_trust.py::test_the_restricted_unpickler_refuses_any_other_global"),
    Case("checkpoint trust", "a pickle that rewires an allowed class (BUILD on a class)", "hand-written opcodes",
         "CheckpointError: 'sets attributes of a class'", "-",
         "test_checkpoint_trust.py::test_the_restricted_unpickler_refuses_setting_attributes_of_an_allowed_class"),
    Case("checkpoint trust", "metadata.json naming a storage backend qarl does not read", "sharded_backend=zarr",
         "one line naming metadata.json", "2", "test_checkpoint_trust.py::test_a_storage_backend_qarl_does_not_read_is_"
                                               "refused"),
    # ------------------------------------------------------------ integrity
    Case("integrity", "a bit-flipped shard given to a conversion or as model.init_checkpoint",
         "one byte of a .distcp inverted (same size)", "one line naming the shard: its sha256 differs from the one "
         "recorded; nothing written", "2",
         "test_checkpoint_trust.py::test_a_bit_flipped_shard_is_refused_by_conversions_and_init_checkpoints"),
    Case("integrity", "a damaged newest checkpoint under resume=auto", "a shard truncated",
         "a warning naming both checkpoints; resumes the previous complete one", "0",
         "test_reliability_checkpoints.py::test_resume_auto_falls_back_past_a_damaged_newest_checkpoint"),
    Case("integrity", "a damaged completion marker under resume=auto", "marker cut short / random bytes / a file "
         "name outside the checkpoint", "'qarl_checkpoint.json is damaged'; resumes the previous complete one (it "
         "used to crash, again at every requeue)", "0",
         "test_checkpoint_trust.py::test_resume_auto_falls_back_past_a_damaged_marker"),
    Case("integrity", "a directory of random bytes named like checkpoint files", "random .metadata, shards, "
         "common.pt, metadata.json, side state; marker random or forged to match",
         "one line: the marker, or the side-state file, 'is damaged' (not a UnicodeDecodeError traceback, not "
         "'holds objects other than tensors')", "2",
         "test_reliability_faults.py::test_random_bytes_named_like_checkpoint_files_are_one_line"),
    # ------------------------------------------------------------ the refit: the engine computes what was published
    Case("refit", "a refit that loses a bucket on the way (publish.verify off)",
         "the engine drops the second bucket of the third publish (tests/dist/plant_refit_fault.py)",
         "the refit canary: one line naming the engine, rollout group, the publish and the worst tokens; the "
         "steps before it logged with canary/*; no rollout on those weights", "2",
         "test_canary.py::test_a_refit_the_engine_mishandled_stops_the_run_before_a_rollout_samples_from_it"),
    Case("refit", "a refit that skips a layer, or a derived tensor (the weights the engine computes with not "
         "re-derived from the codes it keeps: a checksum of what it keeps matches)",
         "the engine drops layer 1's tensors / skips its dequantize into the model at the third publish",
         "the same canary line, exit 2, before the next rollout", "2",
         "test_canary.py::test_a_refit_the_engine_mishandled_stops_the_run_before_a_rollout_samples_from_it"),
    Case("refit", "a publish that lands on an engine whose weights were then restored from a stale copy",
         "after the third publish the engine loads the state it held after the first",
         "the same canary line, exit 2", "2",
         "test_canary.py::test_a_refit_the_engine_mishandled_stops_the_run_before_a_rollout_samples_from_it"),
    Case("refit", "the quantization switch that never reached the engine process (it would serve the codes as "
         "bf16)", "the engine built without the run's quantization_config",
         "one line before the first rollout: 'does not serve the learner's quantization: it serves "
         "quant.scheme=none'", "2",
         "test_canary.py::test_an_engine_started_without_the_runs_quantization_is_refused_at_start"),
    Case("refit", "an engine quantization config that differs from the trainer's spec: group 64 vs 128, a "
         "quantized router, an ignore regex swallowing a layer, another format or scale encoding",
         "engine quantization_configs edited", "one line naming what differs (already so before issue 43)", "2",
         "test_engine_quantization.py::test_what_peers_hit_is_each_named_in_one_line"),
    Case("refit", "an engine ignore list with a plain entry that is a substring of quantized linears "
         "(`mlp.gate` inside `gate_up_proj`: an engine matching by substring leaves them bf16)",
         "a served quantization_config with 'mlp.experts.1' added (part of experts 1's linears)",
         "one line naming the entry, how many linears it is part of, and the fix (full names or 're:')", "2",
         "test_engine_quantization.py::test_a_plain_ignore_entry_inside_quantized_linear_names_is_refused"),
    # ------------------------------------------------------------ the run directory
    Case("run directory", "a second trainer started on a live run's directory", "two qarl-train on one out dir",
         "refused before it reads, moves or removes anything: one line naming the holder's pid and host; the "
         "first run and its in-progress checkpoint are untouched", "2",
         "test_run_survival.py::test_a_second_trainer_on_the_same_dir_is_refused_and_the_first_one_is_untouched"),
    Case("run directory", "a lock holder killed with SIGKILL", "a process holding the lock, SIGKILLed",
         "the kernel releases the lock; the next run starts", "-",
         "test_run_survival.py::test_a_run_dir_lock_is_released_by_the_kernel_when_its_holder_is_killed"),
    Case("run directory", "temp dirs of killed saves beside a live writer's", "`.step_*.tmp-<pid>-*` with a dead, "
         "a live and no pid", "the dead ones are reported and removed; a live writer's is never touched", "-",
         "test_run_survival.py::test_clean_stale_removes_dead_writers_temp_dirs_only"),
    Case("run directory", "another run's higher-numbered checkpoints in the checkpoint dir",
         "a step_00000100 of another run id; this run resumes step 1 with keep_last=1",
         "pruning removes only this run's own checkpoints (it used to delete the new run's at once)", "0",
         "test_run_survival.py::test_keep_last_prunes_only_this_runs_own_checkpoints"),
    # ------------------------------------------------------------ stopping
    Case("stopping", "SIGTERM (Slurm preemption, kill), SIGUSR1 (Slurm --signal), Ctrl-C", "the signal sent to a "
         "running qarl-train", "the step in flight finishes and is checkpointed; one line 'stopped by SIG... after "
         "step N/M; checkpoint ... written'; the same command resumes from it", "3",
         "test_run_survival.py::test_a_stop_signal_finishes_the_step_checkpoints_and_exits_3"),
    Case("stopping", "SIGTERM during a rollout (hours on GPUs: a step-boundary stop would overrun Slurm's grace)",
         "the signal while step 2's first reward call runs (a slow reward plug-in, 4 requests per step)",
         "the requests in flight are abandoned, step 1 is checkpointed, one line 'after step 1/40, during step 2's "
         "rollout (...)'; the resumed run scores the same prompts again", "3",
         "test_run_survival.py::test_a_stop_during_a_rollout_abandons_it_checkpoints_the_last_complete_step_and_"
         "exits_3"),
    Case("waiting", "a rollout leader works longer than the process groups' timeout (NCCL's watchdog: 10 min by "
         "default) while the other ranks wait", "parallel.distributed_timeout_minutes=0.1, a 12 s engine request "
         "on rank 0 under torchrun", "the waiting rank waits on the store, logging every "
         "parallel.rank_wait_log_interval_s; both ranks get their batch (the same wait in a collective fails)", "-",
         "test_rank_wait.py::test_a_rollout_longer_than_the_groups_timeout_no_longer_kills_the_ranks_that_wait_for_it"),
    Case("waiting", "a leader fails during a long phase, or never finishes it", "a non-engine error on rank 0's "
         "request; a wait past parallel.rank_wait_timeout_minutes", "every rank ends: the others with a line naming "
         "rank 0's error; a wait past the deadline with one line naming the phase and the key", "-",
         "test_rank_wait.py::test_a_rollout_longer_than_the_groups_timeout_no_longer_kills_the_ranks_that_wait_for_it"),
    Case("stopping", "the stop file ($QARL_STOP_FILE) appears", "touch", "as a signal", "3",
         "test_run_survival.py::test_the_stop_file_stops_the_run_like_a_signal"),
    Case("stopping", "a second Ctrl-C", "two SIGINTs 1.5 s apart", "stops at once: one line, no traceback, the step "
         "in flight not checkpointed", "130",
         "test_run_survival.py::test_a_second_ctrl_c_stops_at_once_without_a_traceback"),
    Case("stopping", "SIGTERM to every process of the run (Slurm signals a whole job step)", "killpg on the run's "
         "session, math_verify reward workers and megatron's checkpoint Manager in it", "the helpers outlive it "
         "(stop signals are their owner's); the step finishes and is checkpointed", "3",
         "test_run_survival.py::test_sigterm_to_every_process_of_the_run_still_stops_it_gracefully"),
    Case("stopping", "under torchrun, a signal that reaches one rank, or torchrun (which forwards SIGTERM)",
         "SIGTERM to rank 1's worker / to torchrun", "every rank stops after the same step (a max over a flag at "
         "the step boundary); one checkpoint with every rank's shards; rank 0's line", "3 (workers)",
         "test_run_survival.py::test_under_torchrun_every_rank_stops_after_the_same_step"),
    Case("stopping", "SIGKILL while a checkpoint is written", "SIGKILL with megatron's writer processes alive",
         "no orphan; the next run reports and removes the temp dir and resumes the last complete checkpoint", "0",
         "test_trainer.py::test_sigkill_during_checkpoint_write_leaves_no_orphan_and_resumes"),
    # ------------------------------------------------------------ writes
    Case("writes", "a full disk, a read-only file system, a file-size limit, as safetensors reports them (its own "
         "SafetensorError, not OSError)", "safetensors' serialize_file raising its error with os error 28 / 30 / 27",
         "one line naming --out and the cause; no temp dir left; the source untouched", "2",
         "test_reliability_faults.py::test_export_whose_writes_safetensors_refuses_is_one_line"),
    Case("writes", "RLIMIT_FSIZE during qarl-convert export", "resource.setrlimit in the child",
         "one line 'File too large', naming --max-shard-bytes and ulimit -f; nothing at --out", "2",
         "test_reliability_faults.py::test_export_under_a_file_size_limit_is_one_line"),
    Case("writes", "--out (or its parent) is a symbolic-link loop", "`ln -s loop loop`",
         "one line naming the link; the link untouched", "2",
         "test_reliability_faults.py::test_out_that_is_a_symlink_loop_is_one_line"),
    # ------------------------------------------------------------ inputs
    Case("inputs", "NaN / Inf in the HF weights a run starts from (model.hf_path)", "one NaN in an expert weight",
         "refused while loading, naming the tensor and the file (it used to surface as 'the published weights "
         "have diverged')", "2",
         "test_reliability_faults.py::test_nan_in_the_hf_weights_a_run_starts_from_is_one_line_at_load"),
    Case("inputs", "prompt tokens + rollout.max_new_tokens past the model's context (max_position_embeddings)",
         "rollout.max_new_tokens=508 / 600 on the 512-token tiny model", "one line naming the row, the numbers and "
         "the keys to change", "2",
         "test_reliability_faults.py::test_prompts_plus_max_new_tokens_past_the_context_are_refused"),
    Case("inputs", "a dataset with fewer usable prompts than train.prompts_per_step", "a 1-row JSONL, 4 prompts "
         "per step", "one line naming both numbers", "2",
         "test_reliability_faults.py::test_a_dataset_smaller_than_one_step_is_refused"),
    Case("inputs", "a model directory without tokenizer files (model.tokenizer unset)", "config.json + weights only",
         "one line naming the directory and model.tokenizer (it used to fail deep in the engine)", "2",
         "test_reliability_faults.py::test_a_model_dir_without_a_tokenizer_is_refused_naming_it"),
    Case("inputs", "a reward plug-in that hangs", "a plug-in that sleeps forever, data.reward_timeout_s=0.5",
         "killed at data.reward_timeout_s per response of its batch; one line naming the plug-in and the deadline "
         "(it used to hang the run forever)", "2",
         "test_reliability_faults.py::test_a_reward_plugin_that_hangs_stops_the_run_with_one_line"),
    Case("inputs", "a reward plug-in that sleeps or spins forever, or kills its own process",
         "RewardFunction called directly", "RewardError naming the plug-in (and the deadline); the next call gets "
         "a fresh worker", "-", "test_rl_rewards.py::test_a_hanging_plugin_is_killed_at_its_deadline_and_is_one_line"),
    Case("inputs", "stop signals reaching the reward workers from outside (Slurm, a terminal)", "`kill -TERM/-INT/"
         "-USR1` from another process", "ignored: the workers live until the trainer stops them", "-",
         "test_rl_rewards.py::test_reward_workers_outlive_stop_signals_that_are_not_the_trainers"),
    # ------------------------------------------------------------ plug-ins that end their process (issue 49)
    Case("plug-ins", "a reward plug-in that ends its process in a call: SystemExit(0), sys.exit(3), KeyboardInterrupt, "
         "another BaseException, os._exit(0), a signal", "each from `fn(responses, answers, rows)`, deadline 60 s",
         "one line naming the plug-in and what it did, at once (SystemExit(0) used to end qarl-train with 0 and "
         "nothing written, KeyboardInterrupt as 'interrupted (Ctrl-C)' 130, os._exit(0) was waited on for the whole "
         "deadline and called too slow)", "2",
         "test_plugin_endings.py::test_every_way_a_plugin_call_can_end_is_one_line_at_once"),
    Case("plug-ins", "a reward plug-in module that ends its process at import (sys.exit(3), SystemExit(0), "
         "KeyboardInterrupt, os._exit(0))", "the module's top level", "the config check imports it in a worker, never "
         "in the trainer: one line naming it and what it did (sys.exit(3) used to exit 3, 'stopped on request, run "
         "again', which loops a requeue script; os._exit(0) ended the trainer with 0)", "2",
         "test_plugin_endings.py::test_a_plugin_module_that_ends_its_process_at_import_is_one_line"),
    Case("plug-ins", "the same through qarl-train", "data.reward=<module>:<function> ending in the preflight's call "
         "or at import", "one line, before the model is built; no metrics", "2",
         "test_plugin_endings.py::test_qarl_train_with_a_plugin_that_ends_its_process_is_one_line_and_exit_2"),
    Case("plug-ins", "processes a reward plug-in starts", "`sleep 300` started in a call; the worker closed, ended "
         "by os._exit, killed at the deadline", "killed with the worker (its process group, by a reaper that "
         "waits for the worker's end); they used to outlive the run", "-",
         "test_plugin_endings.py::test_processes_a_plugin_starts_end_with_its_worker"),
    Case("plug-ins", "the trainer SIGKILLed while a plug-in's child runs", "SIGKILL of the process holding the "
         "reward function", "the worker dies with the trainer, the child with the worker", "-",
         "test_plugin_endings.py::test_processes_a_plugin_starts_end_when_the_trainer_is_killed"),
    Case("plug-ins", "a plug-in that stops a process it started (`terminate()`, a multiprocessing pool's exit)",
         "Popen(sleep 300).terminate() in a call", "works: the worker ignores outside stop signals with a handler its "
         "children do not inherit (they used to inherit a blocked SIGTERM: terminate() hung until the deadline)", "-",
         "test_plugin_endings.py::test_processes_a_plugin_starts_keep_the_default_stop_signals"),
    Case("stale state", "a `$QARL_STOP_FILE` left from an earlier stop", "the file exists when qarl-train starts "
         "(train, sft, --dry-run)", "refused before the config is read, naming the file and the fix (remove it); it "
         "used to load the model and stop again at the first step, exit 3 'run again', a requeue loop", "2",
         "test_bad_inputs_round3.py::test_a_stop_file_left_from_an_earlier_stop_is_refused_before_anything_is_built"),
    Case("bad inputs", "values out of range that passed: a non-finite number in any key (train.optim.lr=inf, "
         "rollout.temperature=inf, ...), rollout.n=1, a one-element train.optim.betas",
         "overrides", "one line per key, before anything is built: 'is not a finite number' (any section); n=1 'has no "
         "baseline, every advantage is 0'; betas 'give exactly 2 values (got 1)' (it used to say 'error: ?: None')",
         "2", "test_bad_inputs_round3.py::test_values_out_of_range_are_refused_naming_the_key"),
    Case("bad inputs", "a low-bit format the chosen engine cannot refit in place: quant.scheme=nvfp4 with "
         "rollout.engine=sglang (SGLang 0.5.23's NVFP4 methods delete the parameters they load into after loading)",
         "overrides", "one line at the config check, before anything is built: why, and what runs instead "
         "(quant.scheme=w4a16 / fp8 / none, or rollout.engine=embedded for nvfp4)", "2",
         "test_quant_nvfp4.py::test_sglang_with_nvfp4_is_refused_in_one_line_naming_the_alternatives"),
    Case("bad inputs", "data rows past the JSON reader's limits: a 5,000-digit answer, a row nested 100,000 deep, "
         "a .json array nested too deep", "rows written to .jsonl / .json",
         "the long number is read as its digits (an answer); a row nested past 64 levels is a malformed row "
         "(data.bad_rows: skipped, or one line naming the row); the .json file: one line naming it (each used to "
         "crash the reader with a traceback)", "2 / 0",
         "test_bad_inputs_round3.py::test_data_rows_past_the_json_readers_limits_are_read_or_reported"),
    Case("bad inputs", "paths a run cannot use: a FIFO as data.path, logging.out_dir a regular file, the current "
         "directory (logging.out_dir=.) or one above it, an init checkpoint inside an out dir that "
         "logging.overwrite would move", "mkfifo; a file; `.` / `..`; model.init_checkpoint=<out_dir>/sft",
         "one line naming the key and the fix, nothing written or moved (the FIFO used to hang the run; `.` let "
         "logging.overwrite move the whole working directory aside; the init checkpoint was moved before it was "
         "read)", "2", "test_bad_inputs_round3.py::test_paths_a_run_cannot_use_are_refused_before_anything_is_built"),
    Case("bad inputs", "the probe's argument errors: --out in a missing directory or a directory, a missing --prompts, "
         "--num-prompts 0, --temperature inf", "python -m megatron_qarl.probe ...", "refused before the model is read "
         "(--out used to fail after the whole probe ran); usage + one line; the probe's refusals exit 2, not 1", "2",
         "test_bad_inputs_round3.py::test_the_probes_argument_errors_are_refused_before_it_runs_with_exit_2"),
    Case("bad inputs", "WANDB_API_KEY set and no reachable wandb server", "WANDB_BASE_URL at a closed loopback port",
         "one line ('the server ... cannot be reached; logging offline ... wandb sync it later') and the run logs "
         "offline, in seconds (it used to end with a traceback after wandb's minutes of retries)", "0",
         "test_bad_inputs_round3.py::test_a_wandb_key_with_no_reachable_server_logs_offline_with_one_line"),
    Case("bad inputs", "a model config that contradicts itself: num_experts_per_tok 0 (or above num_experts), heads "
         "that KV heads do not divide, 0 layers; a tokenizer with more tokens than vocab_size; no EOS token and no stop",
         "config.json / the saved tokenizer edited", "one line naming the file and the fix: the HF config's counts "
         "at the config check, the tokenizer's where the run checks its inputs, before the model (they used to be "
         "accepted until a traceback in the build, or responses that never end)", "2",
         "test_bad_inputs_round3.py::test_a_model_config_that_contradicts_itself_is_refused_before_the_model"),
    Case("bad inputs", "special-token text in a prompt row (`<|im_start|>assistant`, `<eos>`): encoded as the real "
         "token, it can forge a turn", "a row holding `<eos>`", "a warning (not a refusal: verl, slime and transformers "
         "encode it the same way, and chat-formatted prompts exist on purpose) naming how many rows and the first; "
         "it used to pass without a word", "0",
         "test_bad_inputs_round3.py::test_special_token_text_in_the_prompts_is_a_warning_naming_the_row"),
    Case("writes", "qarl-convert hf-to-mcore on a full disk, or Ctrl-C while it writes", "RLIMIT_FSIZE in the child "
         "(torch-DCP wraps the writer's error in a CheckpointException, a BaseException); KeyboardInterrupt from the "
         "shard writer", "one line naming --out and the cause (or 'interrupted (Ctrl-C)'); nothing at --out, no temp "
         "dir left (both used to be a traceback)", "2 / 130",
         "test_bad_inputs_round3.py::test_hf_to_mcore_on_a_full_disk_or_interrupted_is_one_line_and_leaves_nothing"),
    # issue 49 item 3 (data lost or put at risk) and item 6's safetensors headers: tests/test_reliability_round3.py
    Case("run directory", "a second `qarl-train sft` on a live SFT run's logging.out_dir or sft.out_checkpoint",
         "the lock held by the test process", "refused before anything is built, naming the holder's pid and host "
         "(SFT took no lock)", "2", "test_reliability_round3.py::test_a_second_sft_run_on_a_live_ones_directories_is_refused"),
    Case("run directory", "a second SFT run on an existing sft.out_checkpoint", "the same command twice",
         "one line naming the choices (a new sft.out_checkpoint, or sft.overwrite=true: moved to "
         "`<path>.old-<timestamp>`, nothing deleted); sft.overwrite defaulted to true and the second run silently "
         "replaced the first", "2",
         "test_reliability_round3.py::test_a_second_sft_run_on_the_same_out_checkpoint_is_refused_or_moves_it_aside"),
    Case("run directory", "checkpoint.resume=auto on a checkpoint.dir shared with another run (another seed, lr or "
         "out dir)", "two qarl-train, the second with train.seed=7", "one line naming that run's id and the keys "
         "that differ; nothing of either run touched (it used to resume the other run, take its run id and prune its "
         "steps); the same command again (a requeue) still resumes; resume=<path> or force continues it on purpose",
         "2", "test_reliability_round3.py::test_a_second_run_on_a_shared_checkpoint_dir_does_not_take_over_the_first_ones"),
    Case("run directory", "the run-dir lock `.qarl.lock` planted as a link (symbolic or hard) in a copied or shared "
         "run dir", "a link to a file outside the run", "refused in one line naming the link; the file it points to "
         "is untouched (it used to be truncated and overwritten with the lock's pid line)", "2",
         "test_reliability_round3.py::test_a_planted_lock_file_link_is_refused_and_its_target_untouched"),
    Case("run directory", "metrics.jsonl, samples.jsonl or eval_samples.jsonl planted as a symbolic link, at the "
         "start or during the run", "a link to a file outside the run", "refused in one line (O_NOFOLLOW, no other "
         "hard links); no row is written through it (a resumed run appended its rows to the link's target)", "2",
         "test_reliability_round3.py::test_a_planted_metrics_file_link_gets_no_rows_through_it"),
    Case("run directory", "error.log planted as a symbolic link", "a link to a file outside the run, then a failure",
         "the traceback goes to the temp-dir fallback (qarl-error-<pid>.log), the link's target untouched (it got "
         "the traceback appended)", "-", "test_reliability_round3.py::test_a_planted_error_log_link_gets_no_traceback_through_it"),
    Case("stopping", "SIGTERM / SIGUSR1 / Ctrl-C / the stop file during `qarl-train sft`", "a real SIGTERM inside "
         "step 2 of 4", "the step finishes, the model, optimizer and histories go to `<sft.out_checkpoint>.resume`, "
         "one line, exit 3; the same command continues it to the very losses of an uninterrupted run (it used to die "
         "at once, the whole warm-up lost); a run of other settings (sft.seed, sft.lr, ...) is refused that state "
         "in one line naming the keys", "3 / 0 / 2",
         "test_reliability_round3.py::test_sft_stops_at_a_step_boundary_with_its_state_and_the_same_command_continues_it"),
    Case("stopping", "a second Ctrl-C during `qarl-train sft`", "KeyboardInterrupt in a step",
         "one line saying what a next run has (nothing, or the state of an earlier stop); it promised 'the last "
         "complete checkpoint stands (checkpoint.resume=auto continues from it)', which SFT did not have", "130",
         "test_reliability_round3.py::test_a_second_ctrl_c_in_sft_promises_no_resume_that_does_not_exist"),
    Case("stopping", "SIGKILL during the per-step publish (after the step's checkpoint, before its row)",
         "the publisher's third call SIGKILLs the process", "the checkpoint keeps the step's row; the resumed run logs "
         "it (restored_from_checkpoint=1, without the publish metrics that never happened): metrics and samples "
         "rows 0, 1, 2 (rows 0, 2 remained: a hole for good)", "-9 / 0",
         "test_reliability_round3.py::test_a_sigkill_during_the_publish_leaves_no_hole_in_metrics_or_samples"),
    Case("inputs", "a `model.safetensors.index.json` whose weight_map names a file outside the checkpoint (absolute, "
         "`../`, empty) or is not {tensor: file}", "a valid safetensors file beside the checkpoint, named by the index",
         "one line naming the index entry; nothing read from outside (it was read from there)", "2",
         "test_reliability_round3.py::test_an_index_naming_a_file_outside_the_checkpoint_is_refused"),
    Case("inputs", "a safetensors header that parses as JSON but is not what the format allows: a list or string, "
         "non-UTF-8 or lone-surrogate names, overlapping / inverted / gapped offsets, bytes after the last tensor, no "
         "data_offsets, nested `__metadata__`, dtype x shape not the offsets' size, an unknown dtype, a negative "
         "dimension, a duplicate name", "one file per class (parametrised)", "one line naming the file and the "
         "class, from the header check (it passed it, then crashed with a traceback or read the wrong bytes)", "2",
         "test_reliability_round3.py::test_a_safetensors_header_the_format_does_not_allow_is_one_line"),
    Case("inputs", "the same header as model.hf_path of a run", "a header that is a JSON list",
         "refused before the model is built (the run used to build it first: minutes at 30B)", "2",
         "test_reliability_round3.py::test_a_bad_header_is_refused_before_the_run_builds_the_model"),
]


HEAD = """# Reliability: faults, bad inputs, and what each gets

<!-- generated by tests/reliability_catalogue.py from its CASES; tests/test_reliability_catalogue.py keeps it in
sync. Edit the cases there, then run `python tests/reliability_catalogue.py`. -->

## Trust model

**A checkpoint from elsewhere is data, never code.** Every checkpoint qarl reads (a run's `step_*`, an SFT or
`qarl-convert hf-to-mcore` output, anything handed to `checkpoint.resume`, `model.init_checkpoint`,
`sft.init_checkpoint`, `qarl-convert inspect / mcore-to-hf / export --ckpt`) may have been written by someone
else. torch's FileSystemReader reads `.metadata` with plain `pickle.load`, its load planner unpickles the shards'
byte entries with `weights_only=False`, and megatron reads `common.pt` with torch.load's default: each could run
code. So before torch or megatron touches a checkpoint, `checkpointing.trust.check_no_code` reads every pickle in it
the way it must be readable: `.metadata` with a restricted unpickler that builds only torch-DCP's metadata
records, `torch.Size`, dtypes and plain containers; the byte entries, `common.pt` and `qarl_extra_state.pt` with
torch's weights-only loader. Anything else is one line (`CheckpointError`, exit status 2) and nothing of it runs.

**The digests catch damage, not an attacker.** The completion marker (`qarl_checkpoint.json`) records every
file's size and sha256; every read verifies them (resume, init checkpoints, every conversion, inspect). Whoever
ships a checkpoint can rewrite the marker too, which is why the pickles are checked whatever the marker says
(the tests plant payloads both ways).

**A run owns its directory.** The logging rank holds an `fcntl` lock on `<out_dir>/.qarl.lock` (and on
`checkpoint.dir` when it lies elsewhere) for the run's life; the kernel releases it however the run ends. Clean-up
never removes a live writer's temp dir, and `checkpoint.keep_last` prunes only the checkpoints whose marker
carries this run's id (a resumed run takes its checkpoint's). `checkpoint.resume=auto` continues only this run's
own checkpoints: each records its run settings (`train.seed`, `train.optim`, and `logging.out_dir` when
`checkpoint.dir` lies elsewhere), so the same command again (a requeue) resumes and another run on a shared
`checkpoint.dir` is refused. The lock, metrics.jsonl, samples.jsonl, eval_samples.jsonl and error.log are opened
with `O_NOFOLLOW` and refused when they are links (symbolic, or hard links to a file elsewhere): nothing a run
writes follows a link out of its directory. `qarl-train sft` holds the same lock on its `logging.out_dir` and its
`sft.out_checkpoint`, and refuses an existing `sft.out_checkpoint` (`sft.overwrite=true` moves it aside).

## Exit status

| status | meaning |
|---|---|
| 0 | done |
| 1 | a bug, not something the user can fix: a traceback |
| 2 | a problem the user can fix: one line naming it and the fix (`qarl-train: error: ...`, `qarl-convert: error: ...`) |
| 3 | stopped on request (SIGTERM, SIGUSR1, Ctrl-C, the stop file) after checkpointing the last complete step (the step in flight, or the steps before an abandoned rollout): run the same command again (`checkpoint.resume=auto`) |
| 130 | a second Ctrl-C: stopped at once, the step in flight not checkpointed |

## Stopping a run

SIGTERM, SIGUSR1, SIGINT (Ctrl-C) and the file named by `$QARL_STOP_FILE` only *ask* the run to stop: at the
next step boundary every rank agrees (a max over a flag), the finished step is checkpointed (whatever
`checkpoint.every` says), the engines and reward workers are stopped, and qarl-train prints one line and exits
with status 3. **A stop that arrives during a rollout** (on GPUs the longest phase by far, an hour and more)
does not wait for it: the leader that sees it (within a poll, 0.2 s; a reward call in progress finishes first)
starts and retries no request, has its engine abort the ones it serves (SGLang's /abort_request) and waits,
at most 60 s, until the engine is idle (it must be, to give its memory back for the checkpoint); every rank learns
it at the end of the rollout phase, the last complete step
is checkpointed (unless `checkpoint.every` or the resume already saved it) and the run exits 3 ("after step
N/M, during step N+1's rollout"). What is lost: the abandoned step's responses only (the engine's time on
them); the data position goes back to before that step, so the resumed run samples the same prompts with the
same seeds. A stop that reaches a non-leader rank only is honoured at the step boundary. A stop asked before the first step exits 3 with nothing new to save; one asked during the last
step lets the run finish (exit 0) unless the final evaluation remains. If the step in flight fails after the
request (for example the signal also reached an SGLang server), the run still exits 3 and says that the previous
checkpoint stands. A second Ctrl-C (more than a second after the first) stops at once (130).

Helpers the trainer starts (reward workers, megatron's checkpoint Manager) ignore stop signals that do not come
from the trainer, because Slurm signals every process of a job step and a terminal's Ctrl-C the whole foreground
group: they must live until the trainer has finished its step. Engines started as servers (SGLang, vLLM) are
third-party processes and do stop on such a signal; under Slurm, signal the batch shell only and use the stop
file (below), so the servers never see it.

**Under torchrun**, torchrun forwards SIGTERM / SIGINT to its workers and SIGKILLs them after
`--shutdown-timeout` (default 30 s): raise it above a step plus a checkpoint. SIGUSR1 is not forwarded by
default and its default action kills torchrun (and so the workers): add it with `--signals-to-handle
SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1`, or use the stop file. torchrun reports its workers' status 3 as a
failure of its own (`exitcode: 3` in its summary).

**Under Slurm** (requeue on preemption or at the time limit), in the batch script:

```bash
#SBATCH --requeue                  # a preempted or requeued job runs again; checkpoint.resume=auto continues it
#SBATCH --signal=B:USR1@600        # SIGUSR1 to the batch shell only, 10 min before the time limit
export QARL_STOP_FILE="$LOG_DIR/stop-${SLURM_JOB_ID}"   # on a file system the trainer's rank 0 sees
rm -f "$QARL_STOP_FILE"
trap 'touch "$QARL_STOP_FILE"; STOP_REQUESTED=1' USR1
srun ... torchrun --shutdown-timeout 900 ... -m megatron_qarl.cli ... &   # background: bash runs traps only
SRUN_PID=$!                                                              # between commands or in `wait`
rc=0; wait "$SRUN_PID" || rc=$?
while kill -0 "$SRUN_PID" 2>/dev/null; do rc=0; wait "$SRUN_PID" || rc=$?; done   # a trap ended `wait` early
if [ -n "${STOP_REQUESTED:-}" ]; then scontrol requeue "$SLURM_JOB_ID"; fi      # run again from the checkpoint
```

Preemption with a `GraceTime` sends SIGTERM to every process of the job: the trainer stops after its step as
above (give GraceTime at least a step plus a checkpoint).

## The catalogue

Each row is a test that injects the fault (a real signal, a real second trainer, a real file-size limit, a
patched writer where the file system cannot be made to fail) and asserts the exit status, the one line, and
that no file the user had was lost.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    lines = [HEAD]
    area = None
    for case in CASES:
        if case.area != area:
            area = case.area
            lines += ["", f"### {area}", "", "| fault or bad input | injected by | what the user gets | exit | test |",
                      "|---|---|---|---|---|"]
        file, _, func = case.test.partition("::")
        lines.append(f"| {_cell(case.fault)} | {_cell(case.injected)} | {_cell(case.gets)} | {case.exit} | "
                     f"`{file}::{func}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/reliability.md is not up to date")
    parser.add_argument("--out", default=str(DOC))
    args = parser.parse_args(argv)
    out, text = Path(args.out), render()
    if args.check:
        if not out.is_file() or out.read_text(encoding="utf-8") != text:
            print(f"{out} is stale: run python tests/reliability_catalogue.py", file=sys.stderr)
            return 1
        return 0
    out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
