"""Breaks of the training library: the live hand-over, notice checkpoints, background saves,
pure FSDP's reshard and peer copy."""

from __future__ import annotations

from tests.breaks.model import Break, _in

HO = _in("elastic/test_handover.py")
CW = _in("elastic/test_checkpoint_writer.py")

# --- the live rank hand-over: tensors from the survivors at the newest step -------------------
HO_PY = "workers/elastic/handover.py"
HANDOVER_BREAKS = [
    Break(
        "checkpoint retention spares a newer save still being written",
        "workers/elastic/checkpoint.py",
        "if step < newest and step not in complete:",
        "if step not in complete:",
        _in("elastic/test_checkpoint.py")(
            "test_retention_keeps_last_k_and_the_loaded_one_and_removes_leftovers"
        ),
    ),
    Break(
        "background checkpoint: written in the writer process",
        "workers/elastic/checkpoint.py",
        'background="process" if stager else "thread"',
        'background="thread"',
        CW("test_a_background_save_writes_in_a_process_of_its_own_at_nice_19"),
    ),
    Break(
        "background checkpoint: from a thread unless the process is asked for",
        "workers/elastic/checkpoint_writer.py",
        'asked = os.environ.get(WRITER_ENV) or "thread"',
        'asked = os.environ.get(WRITER_ENV) or "process"',
        CW("test_unless_the_process_is_asked_for_the_save_writes_from_a_thread"),
    ),
    Break(
        "background checkpoint: the shared-memory copy is cached",
        "workers/elastic/checkpoint_writer.py",
        "if _stager is None:",
        "if True:",
        CW("test_staging_reuses_its_shared_memory_copy_across_saves"),
    ),
    Break(
        "live notice: a rank parked on its peers' flag still owes the checkpoint",
        "workers/elastic/live.py",
        "event = elastic.store().control_record(generation) or {}",
        "event = elastic.elastic_event() or {}",
        _in("elastic/test_elastic_lib.py")(
            "test_a_rank_that_heard_of_a_notice_only_from_its_peers_still_owes_its_checkpoint"
        ),
    ),
    Break(
        "hand-over: every rank at the newest step gives",
        HO_PY,
        "sources=[r for r, s in enumerate(steps) if s == top],",
        "sources=[r for r, s in enumerate(steps) if s == top][:1],",
        HO("test_the_ranks_at_the_newest_step_give_and_the_rest_take"),
    ),
    Break(
        "hand-over: buckets packed up to their size",
        HO_PY,
        "        room -= size\n",
        "",
        HO("test_big_tensors_travel_alone_and_small_ones_are_packed_in_order"),
    ),
    Break(
        "hand-over: striped over the sources",
        HO_PY,
        "return sources[bucket % len(sources)]",
        "return sources[0]",
        HO("test_buckets_are_striped_over_the_sources_in_turn"),
    ),
    Break(
        "hand-over: takers load the optimizer state",
        HO_PY,
        'optim.load_state_dict({"state": optim_state, "param_groups": skel["param_groups"]})',
        "pass",
        HO("test_every_rank_ends_with_the_newest_state_striped_over_two_sources"),
    ),
]

# --- pure FSDP's in-memory reshard and peer copy (workers/elastic/sharded.py) --------------
SH_PY = "workers/elastic/sharded.py"
PC = _in("elastic/test_peer_copy.py")
PEER_COPY_BREAKS = [
    Break(
        "peer copy: stepped with the neighbour's gradients (never stale)",
        SH_PY,
        "        self.optim.step()\n        last.copy_step_s",
        "        last.copy_step_s",
        PC("test_a_node_lost_between_steps_is_rebuilt_from_its_peer_copy_bit_for_bit"),
    ),
    Break(
        "peer copy: a lost rank's rows from the node behind it on the ring",
        SH_PY,
        "elif (o - stride) % old_world in copies:",
        "elif (o + stride) % old_world in copies:",
        PC("test_a_lost_nodes_shards_come_from_the_node_behind_it_on_the_ring"),
        more=(
            (
                "sources.append((copies[(o - stride) % old_world], True))",
                "sources.append((copies[(o + stride) % old_world], True))",
            ),
        ),
    ),
    Break(
        "reshard: a survivor a step behind takes the step with its gradients",
        SH_PY,
        "finish = [n for n, h in survivors if h.step < top]",
        "finish = []",
        PC("test_a_survivor_a_step_behind_takes_the_step_only_with_its_gradients_in_hand"),
    ),
    Break(
        "a new generation's mesh forgets DTensor's caches",
        SH_PY,
        "    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()\n",
        "    return\n",
        PC("test_a_new_generations_mesh_is_not_an_old_one_from_dtensors_caches"),
    ),
]
