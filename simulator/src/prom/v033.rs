//! The families vLLM 0.33 prints beside those routers read (the reference body in
//! `filter/core/tests/fixtures/vllm_metrics_v0.33.txt`), with what a simulated server has:
//! every waiting request waits for capacity, the engine is always awake, prompt tokens are
//! computed or found in the device's prefix cache, and there is no KV connector and no
//! multi-modal cache (zeros). Not in the legacy (pre-0.12) naming.

use std::fmt::Write;

use super::{go_float, Out, View};

/// One sample with the server's labels and one more, in vLLM's (sorted) label order.
fn labelled(o: &mut Out<'_>, name: &str, label: &str, value: &str, v: f64) {
    let _ = writeln!(o.text, "{name}{{{},{label}=\"{value}\"}} {}", o.labels, go_float(v));
}

/// A counter family by one label, with its `_created` gauges.
fn labelled_counter(o: &mut Out<'_>, base: &str, help: &str, label: &str, values: &[(&str, f64)]) {
    o.family(&format!("{base}_total"), help, "counter");
    for (value, n) in values {
        labelled(o, &format!("{base}_total"), label, value, *n);
    }
    o.family(&format!("{base}_created"), help, "gauge");
    let created: f64 = o.created.parse().unwrap_or(0.0);
    for (value, _) in values {
        labelled(o, &format!("{base}_created"), label, value, created);
    }
}

pub(super) fn waiting_and_sleep(o: &mut Out<'_>, v: &View<'_>) {
    let name = "vllm:num_requests_waiting_by_reason";
    o.family(
        name,
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
        "gauge",
    );
    labelled(o, name, "reason", "capacity", v.waiting as f64);
    labelled(o, name, "reason", "deferred", 0.0);
    let name = "vllm:engine_sleep_state";
    o.family(
        name,
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        "gauge",
    );
    for (state, on) in [("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)] {
        labelled(o, name, "sleep_state", state, on);
    }
}

pub(super) fn other_caches(o: &mut Out<'_>) {
    for (base, help) in [
        ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens."),
        ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens."),
        ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
        ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
    ] {
        o.counter(base, help, 0.0);
    }
}

pub(super) fn prompt_tokens_by_source(o: &mut Out<'_>, v: &View<'_>) {
    let hits = v.prefix_hits.min(v.prompt_tokens);
    labelled_counter(
        o,
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        "source",
        &[
            ("local_compute", (v.prompt_tokens - hits) as f64),
            ("local_cache_hit", hits as f64),
            ("external_kv_transfer", 0.0),
        ],
    );
}

pub(super) fn cached_by_source(o: &mut Out<'_>, v: &View<'_>) {
    labelled_counter(
        o,
        "vllm:prompt_tokens_cached_by_source",
        "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
        "source",
        &[
            ("device", v.prefix_hits as f64),
            ("host", 0.0),
            ("p2p", 0.0),
            ("disk", 0.0),
            ("external_unspecified", 0.0),
        ],
    );
}

/// `vllm:request_success_created`, after the counter family `render` writes.
pub(super) fn success_created(o: &mut Out<'_>) {
    let name = "vllm:request_success_created";
    o.family(name, "Count of successfully processed requests.", "gauge");
    let created: f64 = o.created.parse().unwrap_or(0.0);
    for reason in ["stop", "length", "abort", "error", "repetition"] {
        // vLLM's label order: engine, finished_reason, model_name.
        let (engine, model) = o.labels.split_once(',').unwrap_or(("", ""));
        let _ = writeln!(
            o.text,
            "{name}{{{engine},finished_reason=\"{reason}\",{model}}} {}",
            go_float(created)
        );
    }
}

/// `vllm:admission_rejections_total` (no `engine` label in vLLM 0.33: the API server counts
/// them), by the limit that refused.
pub(super) fn admission_rejections(o: &mut Out<'_>, v: &View<'_>) {
    let help = "Number of admission attempts rejected by a queue limit, by reason.";
    let reasons = ["max_num_queued_reqs", "max_num_queued_tokens"];
    o.family("vllm:admission_rejections_total", help, "counter");
    for (reason, n) in reasons.iter().zip(v.admission_rejected) {
        let _ = writeln!(
            o.text,
            "vllm:admission_rejections_total{{model_name=\"{}\",reason=\"{reason}\"}} {}",
            v.model,
            go_float(n as f64)
        );
    }
    o.family("vllm:admission_rejections_created", help, "gauge");
    for reason in reasons {
        let _ = writeln!(
            o.text,
            "vllm:admission_rejections_created{{model_name=\"{}\",reason=\"{reason}\"}} {}",
            v.model,
            go_float(o.created.parse().unwrap_or(0.0))
        );
    }
}
