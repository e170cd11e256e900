"""The reviewed lists, one per vLLM series, of vLLM tests that may fail with kvtriton's classes swapped in, each with its reason.

Keys are pytest node ids relative to vLLM's repository root, without the
parameter suffix (an entry covers every parametrization). Only these kinds of
reason belong here: the test reads or patches vLLM's private state, or an
attribute of vLLM's class outside the interface kvtriton implements
(kvtriton's object is a different one; its behaviour is checked through public
results); kvtriton refuses the configuration by design (docs/vllm.md) or with
its own wording; or the test pins vLLM's literal list of config-info labels,
which kvtriton's tiered spec extends by design. Behaviour a vLLM user would
see otherwise never does: such a failure fails the suite.

:data:`ALLOWED_FAILURES` maps each series of :data:`~tests.vllm_compat.vllm_release.RELEASES`
to its list: the entries both releases' selections share are written once
(``_SHARED``), then each series' own.
"""

from __future__ import annotations

_MANAGER = "tests/v1/kv_offload/cpu/test_manager.py"
_SPEC_FACTORY = "tests/v1/kv_offload/test_factory.py"
_TIERING = "tests/v1/kv_offload/tiering/test_tiering_offloading.py"
_BACKPRESSURE = "tests/v1/kv_offload/tiering/test_backpressure.py"
_OBJ = "tests/v1/kv_offload/tiering/test_obj_tier.py"
_P2P = "tests/v1/kv_offload/tiering/p2p/test_manager.py"
_EVENTS = "tests/v1/kv_connector/unit/offloading_connector/test_events.py"
_CONNECTOR_CONFIG = "tests/v1/kv_connector/unit/offloading_connector/test_config.py"

_POLICY = "reads vLLM's private CPUOffloadingManager._policy (its CachePolicy's internal lists)"
_ARC_LISTS = "reads vLLM's private ARC state (manager._policy.t1/t2/b1/b2/target_t1_size)"
_NO_KV_BYTES = (
    "builds a spec with worker_kv_bytes_per_block=0: kvtriton refuses to size host memory before the KV cache is "
    "known (vLLM builds a zero-chunk cache)"
)
_NO_INFO = (
    "constructs the manager without `info`; kvtriton's specs always give their manager its config-info series "
    "(CPUOffloadingInfo), so the series is not empty"
)
_IDENTITY_LABELS = (
    "pins TieringOffloadingSpec's config-info labels to vLLM's literal names; kvtriton's tiered spec declares two "
    "more, kvtriton_identity and kvtriton_identity_source (docs/tiers.md, Integrity), which its own manager fills "
    "and vLLM's frontend reads by name"
)
_SPEC_NUM_CHUNKS = (
    "reads CPUOffloadingSpec.num_chunks, an attribute of vLLM's spec outside the OffloadingSpec interface "
    "(the capacity it then checks is the manager's public config info, which matches vLLM's with num_chunks "
    "read from that info)"
)
_SPEC_CREATE_WORKER = (
    "calls CPUOffloadingSpec.create_worker with vLLM's SharedOffloadRegion and CPUOffloadingWorker patched in "
    "vLLM's module: vLLM's own worker construction, outside the OffloadingSpec interface (kvtriton's is get_worker)"
)
_SPEC_PAGE_SIZE = (
    "reads CPUOffloadingSpec.cpu_page_size_per_worker, an attribute of vLLM's spec outside the OffloadingSpec interface"
)

_SHARED: dict[str, str] = {
    f"{_TIERING}::test_tiering_spec_declares_the_config_info_keys_the_manager_fills": _IDENTITY_LABELS,
    # vLLM's ARC tests inspect T1/T2/B1/B2 directly.
    **{
        f"{_MANAGER}::TestARCPolicy::{name}": _ARC_LISTS
        for name in (
            "test_adaptive_target",
            "test_basic",
            "test_batch_eviction_failure_is_atomic",
            "test_batch_eviction_falls_back_after_t1_iterator_exhausted",
            "test_batch_eviction_scans_t1_and_t2_once",
            "test_eviction_with_load",
            "test_failed_store",
            "test_full_scenario",
            "test_ghost_list_bounds",
            "test_store_falls_back_to_t1_when_t2_cannot_satisfy_eviction",
            "test_t1_t2_eviction_policy",
            "test_t1_to_t2_promotion",
        )
    },
    **{
        f"{_MANAGER}::{name}": _ARC_LISTS
        for name in (
            "test_arc_counts_reuse_once_and_keeps_insertions_in_t1",
            "test_arc_ghost_hit_adapts_once_per_request_before_insertion",
            "test_arc_pending_chunk_is_not_a_frequency_hit",
            "test_arc_reuse_wins_if_same_request_later_reinserts_key",
        )
    },
    **{
        f"{_MANAGER}::{name}": _POLICY
        for name in (
            "test_lru_batch_eviction_failure_is_atomic",
            "test_lru_repeated_pin_cycles_compact_lazy_heap_entries",
            "test_request_finish_forwards_grouped_deduplicated_accesses",
            "test_reset_discards_stale_request_access_classification",
        )
    },
    f"{_MANAGER}::test_cpu_eviction_removed_precedes_stored": (
        "reads CPUOffloadingManager.medium, an attribute of vLLM's class outside the OffloadingManager interface"
    ),
    f"{_MANAGER}::test_cpu_manager_reports_allocation_size_on_allocation_failure": (
        "patches vLLM's private CPUOffloadingManager._allocate_chunks to fail"
    ),
    f"{_MANAGER}::test_evictable_cache_chunk_count": "reads vLLM's private _num_evictable_cache_chunks counter",
    f"{_MANAGER}::test_failed_store_records_access_once_and_uses_store_miss_hook": (
        "patches vLLM's private _record_request_cache_access hook"
    ),
    f"{_MANAGER}::test_filter_reused_manager": "reads vLLM's reuse filter's private `counts` table",
    f"{_MANAGER}::test_store_threshold_does_not_hide_ready_reuse": (
        "reads vLLM's private stores_skipped_in_current_batch counter"
    ),
    f"{_MANAGER}::test_cpu_manager_reports_cache_usage_gauge": (
        "builds a zero-chunk manager: kvtriton refuses a cpu_bytes_to_use that holds no slot"
    ),
    f"{_MANAGER}::test_cpu_manager_reports_no_config_info_without_info": _NO_INFO,
    f"{_TIERING}::test_tiering_manager_reports_one_config_info_series_for_each_tier": _NO_INFO,
    f"{_TIERING}::test_tiering_manager_reports_the_primary_series_with_no_secondary_tier": _NO_INFO,
    f"{_TIERING}::TestTieringOffloadingManager::test_ref_cnt_protection_during_cascade": (
        "reads pin counts through vLLM's private primary._policy during a cascade"
    ),
    f"{_TIERING}::TestTieringOffloadingManager::test_reset_cache_clears_orchestrator_state": (
        "reads vLLM's private primary._num_allocated_chunks"
    ),
    f"{_BACKPRESSURE}::TestBackpressure::test_failed_stores_activate_pressure": _POLICY,
    f"{_BACKPRESSURE}::TestBackpressure::test_throttled_stores_update_metrics_and_release_pins": _POLICY,
    f"{_OBJ}::TestMockObjTierFailures::test_xfer_cleanup_retry_finalizes_parent_job_and_primary_pin": _POLICY,
    **{
        f"{_EVENTS}::{name}": _NO_KV_BYTES
        for name in (
            "test_partial_tier_backpressure_inherits_top_level_defaults",
            "test_tier_override_wins_over_top_level",
            "test_tier_without_backpressure_stays_unconfigured",
            "test_tiering_accepts_self_describing_kv_events",
        )
    },
}
"""Entries for tests both releases' selections hold, failing for the same reason on each."""

_ONLY_0_33: dict[str, str] = {
    # vLLM 0.34 removed touch() from the manager, the tiers and CachePolicy, and these tests with it.
    f"{_MANAGER}::TestARCPolicy::test_touch_ordering": _ARC_LISTS,
    f"{_MANAGER}::test_touch_forwards_req_context_to_policy": _POLICY,
    f"{_TIERING}::TestTieringOffloadingManager::test_touch_propagates_to_all_tiers": _POLICY,
}

_REPLICATED = (
    "expects one copy of replicated (MLA under tensor parallelism) KV, written by rank 0; kvtriton keeps one copy "
    "per rank by design, so the same cpu_bytes_to_use holds 1/world_size of the chunks (docs/vllm.md, "
    "'replicated KV')"
)

_ONLY_0_34: dict[str, str] = {
    **{
        f"{_MANAGER}::{name}": (
            "reads vLLM's reuse filter's private `counts` table after the store offers; every public answer before "
            "it matches (once per request, retries not counted: kvtriton's own test_manager_reuse_filter.py checks "
            "the rule through prepare_store)"
        )
        for name in (
            "test_store_threshold_counts_a_key_once_per_request",
            "test_store_threshold_does_not_count_retries_of_a_failed_offer",
        )
    },
    **{
        f"{_SPEC_FACTORY}::{name}": _REPLICATED
        for name in (
            "test_cpu_config_info_capacity_dedups_a_replicated_layout",
            "test_cpu_spec_replicated_layout_truth_matrix",
            "test_cpu_spec_replicated_sizing_on_shared_region",
            "test_tiering_spec_create_worker_uses_single_slot_for_replicated_layout",
            "test_tiering_spec_replicated_sizing_removes_world_factor",
        )
    },
    f"{_MANAGER}::TestARCPolicy::test_reuse_ordering": _ARC_LISTS,
    f"{_TIERING}::TestTieringOffloadingManager::test_deferred_release_misses_but_holds_chunks_until_released": (
        "reads vLLM's private primary._get_num_free_chunks() and _num_write_pending_chunks (deferred release "
        "itself is checked by the other test_deferred_release_* tests, which read only the primary tier's "
        "public defer_write_release/release_deferred_write/num_deferred_release_chunks)"
    ),
    f"{_P2P}::test_timed_out_load_holds_chunks_until_abort_ack": (
        "reads vLLM's private primary._get_num_free_chunks()"
    ),
    f"{_CONNECTOR_CONFIG}::test_canonical_mla_dsa_rows_are_tp_independent": (
        "asks for the canonical (parallelism-free) host layout, which kvtriton refuses by design: it stores each "
        "rank's own bytes (docs/vllm.md)"
    ),
    # vLLM's spec factory tests build kvtriton's specs where they name CPUOffloadingSpec / TieringOffloadingSpec.
    **{
        f"{_SPEC_FACTORY}::{name}": _SPEC_NUM_CHUNKS
        for name in (
            "test_create_cpu_offloading_spec",
            "test_cpu_config_info_capacity_accounts_for_tensor_parallel_copies",
            "test_cpu_config_info_capacity_shrinks_when_a_second_group_shares_slots",
            "test_cpu_config_info_converts_slots_to_tokens",
            "test_cpu_config_info_no_token_capacity_without_a_kv_cache_group",
            "test_cpu_config_info_no_token_capacity_without_max_model_len",
        )
    },
    f"{_SPEC_FACTORY}::test_cpu_config_info_mirrors_spec_sizing": (
        "reads CPUOffloadingSpec.num_chunks and kv_bytes_per_chunk, attributes of vLLM's spec outside the "
        "OffloadingSpec interface"
    ),
    **{
        f"{_SPEC_FACTORY}::{name}": _SPEC_CREATE_WORKER
        for name in (
            "test_cpu_spec_create_worker_rank_assignment",
            "test_cpu_spec_create_worker_uses_mmap_on_cuda",
            "test_cpu_spec_create_worker_uses_tensor_path_without_shared_region",
        )
    },
    f"{_SPEC_FACTORY}::test_cpu_spec_sizes_normalized_worker_layout": _SPEC_PAGE_SIZE,
    f"{_SPEC_FACTORY}::test_cpu_spec_replicated_disabled_without_shared_region": _SPEC_PAGE_SIZE,
    **{
        f"{_SPEC_FACTORY}::{name}": _NO_KV_BYTES
        for name in (
            "test_cpu_config_info_zero_capacity_is_exact_not_unknown",
            "test_cpu_spec_create_worker_skips_mmap_for_empty_cache",
            "test_cpu_spec_zero_worker_bytes_produces_empty_cache",
        )
    },
    f"{_SPEC_FACTORY}::test_cpu_spec_missing_cpu_bytes_to_use_raises": (
        "pins vLLM's wording ('cpu_bytes_to_use must be specified'); kvtriton refuses the same config with its own "
        "message naming the key"
    ),
    f"{_SPEC_FACTORY}::test_tiering_spec_passes_the_cpu_facts_to_the_primary_tier": (
        "compares the tiered manager's primary config-info series to vLLM's literal mapping; kvtriton's holds the "
        "same five values plus kvtriton_identity and kvtriton_identity_source (docs/tiers.md, Integrity)"
    ),
}

ALLOWED_FAILURES: dict[str, dict[str, str]] = {
    "0.33": {**_SHARED, **_ONLY_0_33},
    "0.34": {**_SHARED, **_ONLY_0_34},
}
"""Each vLLM series' allow-list (keys: the series of :data:`~tests.vllm_compat.vllm_release.RELEASES`)."""


def allow_list_key(nodeid: str) -> str:
    """A node id as the allow-list names it: without the parameter suffix."""
    return nodeid.split("[", 1)[0]
