//! The default of every setting: what a document that leaves a field out gets. The
//! reasons for the numbers are next to them.

use super::{
    ClusterShape, PolicyKind, RawCapture, RawConfig, RawCost, RawDiscovery, RawHashing, RawHealth, RawHold, RawIndex,
    RawOverload, RawReplicas, RawScrape, RawShare, RawTiers, RawWeighted,
};

impl Default for RawDiscovery {
    fn default() -> Self {
        Self {
            admin_cluster: "kvroute_admin".into(),
            cluster: String::new(),
            // Envoy shows an EDS change in /clusters within about 17 ms (DESIGN §8); at 200 ms
            // a new host is in use about a quarter of a second after the change, and polling
            // a 256-host pool stays cheap (BENCHMARKS.md, "Pools that follow Envoy").
            interval_ms: 200,
            timeout_ms: 150,
            max_bytes: 8 << 20,
            models_interval_ms: 10_000,
            lease_ms: 1000,
            resync_ms: 5000,
        }
    }
}

/// The share of each request's TTFT objective the tier rule plans for (`tiers.objective_share`).
pub const OBJECTIVE_SHARE: f64 = 0.6;

impl Default for RawTiers {
    fn default() -> Self {
        Self {
            endpoints: std::collections::BTreeMap::new(),
            from_priority: false,
            ttft_objective_ms: 1000.0,
            objective_header: "x-kvroute-ttft-objective-ms".into(),
            objective_share: OBJECTIVE_SHARE,
            max_num_seqs: Vec::new(),
        }
    }
}

impl Default for RawCapture {
    fn default() -> Self {
        Self {
            sample: 0.0,
            block_bytes: 0,
            salt: String::new(),
            property: "kvroute_capture".into(),
        }
    }
}

impl Default for RawReplicas {
    fn default() -> Self {
        Self {
            peers: Vec::new(),
            cluster: "kvroute_gateways".into(),
            path: "/kvroute/v1/peer-events".into(),
            secret: String::new(),
            // Replay: the cross-replica delay, not the workers' tick, decides TTFT p95 across
            // replicas (BENCHMARKS.md: 8 replicas, shared-prefix p95 63 / 108 / 211 ms at a
            // delay of 0 / 5 / 20 ms).
            interval_ms: 5,
            // Replay, 8 replicas × 16 workers: TTFT p95 −4% to +11% of one router with
            // placements sent within the ms over a 0.25 ms hop, up to +59% with a 5 ms batch.
            at_once: true,
            // Replay, 2 replicas × 8 workers: TTFT p95 up to 4% lower (rag 80%), nothing
            // worse; at 20 POSTs a second per worker the workers' POSTs cost no more than
            // `at_once` alone even when every prompt is a new prefix (BENCHMARKS.md, "The
            // workers' POSTs, bounded"). 5 a second kept every replayed cell's gain: a
            // worker's news is rarer than its requests.
            from_workers: true,
            from_workers_per_s: 20,
            max_body_bytes: 4 << 20,
        }
    }
}

impl Default for RawConfig {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            cluster_shape: ClusterShape::OverrideHost,
            policy: PolicyKind::Cost,
            fallbacks: 2,
            seed: 0,
            max_body_bytes: 4 << 20,
            tenant_header: "x-kvroute-tenant".into(),
            priority_header: "x-kvroute-priority".into(),
            debug_headers: false,
            stored_responses: true,
            hashing: RawHashing::default(),
            scrape: RawScrape::default(),
            health: RawHealth::default(),
            cost: RawCost::default(),
            weighted: RawWeighted::default(),
            overload: RawOverload::default(),
            index: RawIndex::default(),
            share: RawShare::default(),
            discovery: RawDiscovery::default(),
            capture: RawCapture::default(),
            tiers: RawTiers::default(),
        }
    }
}

impl Default for RawHashing {
    fn default() -> Self {
        // 256 bytes is about 64 tokens at the 4-bytes-per-token estimate; 512 blocks cover
        // a 128 KiB (about 32k-token) prefix.
        Self {
            block_bytes: 256,
            max_blocks: 512,
        }
    }
}

impl Default for RawScrape {
    fn default() -> Self {
        Self {
            cluster: "vllm_pool".into(),
            path: "/metrics".into(),
            interval_ms: 200,
            timeout_ms: 150,
            max_bytes: 1 << 20,
            // 128 servers at 200 ms; 256 at 400 ms, under 10% of one core for the scraping
            // side (BENCHMARKS.md, "Polling cost").
            max_per_s: 640,
        }
    }
}

impl Default for RawHealth {
    fn default() -> Self {
        Self {
            unhealthy_after_failures: 2,
            healthy_after_successes: 1,
            stale_after_ms: 1000,
            passive_failures_to_eject: 3,
            eject_ms: 5000,
        }
    }
}

impl Default for RawCost {
    fn default() -> Self {
        // Llama-3-8B on one H100 prefills about 38k tokens/s (DESIGN §6); 20k is a cautious
        // fleet-wide default that still ranks endpoints correctly when they share hardware.
        Self {
            prefill_tokens_per_s: 20_000.0,
            decode_ms_per_running: 0.1,
            kv_pressure_threshold: 0.8,
            kv_pressure_ms: 200.0,
            // Replay, rag at 40 req/s on 4 A100 + 3 H100: with the like-fleet term the
            // H100s' KV ran at 91% and their steady-state TTFT p95 at 1.9 s while the A100s'
            // KV read 34% (whole-run means) (BENCHMARKS, "KV pressure on a fleet of unlike GPUs").
            kv_pressure_unlike_threshold: 0.7,
            kv_pressure_unlike_ms: 1000.0,
            admission_weight: 1.0,
            cold_tolerance: 0.1,
            cold_balance: 16.0,
            served_tokens_kept: 0.5,
            holder_tolerance: 0.3,
            holder_min_share: 0.7,
            // Replay, long-chat on 4 H100 + 4 A100: TTFT p95 115 / 153 / 223 / 456 ms at
            // 50–130% load → 90 / 91 / 94 / 97; tolerance 2: 98 / 120 / 199 / 529. The
            // Mooncake trace there: +4 to +11% with the fill alone as the early sign, +2.4% at
            // 50% since `storage_depth` (BENCHMARKS, "Where the fast GPUs' caches bind").
            storage_tolerance: 3.0,
            storage_fill: 0.15,
            storage_lost_share: 0.3,
            // The same workload with conversations starting at under half the pace (their
            // histories fit the H100s): 92 → 48–52 ms, the matrix's long-chat unchanged, the
            // Mooncake trace's +4 to +11% gone but at 50% (+2.4% against no rule).
            storage_depth: 0.9,
            default_prompt_tokens: 512,
            work_weight: 1.0,
            // vLLM loads an adapter from its CPU cache in milliseconds and from disk in tens
            // to hundreds: a server that has it loaded wins unless clearly busier.
            lora_load_ms: 50.0,
            learn_speeds: true,
            speed_weights: std::collections::BTreeMap::new(),
            speed_weights_from_envoy: false,
            phase_weight: 0.0,
            // A cold 2,182-token prompt sent where a 134-token sibling was about to start
            // took that sibling from ~10 to ~55 ms (replay, shared-prefix): 0.5 gave
            // shared-prefix and rag below capacity 0.3-1.6% lower TTFT p95, Mooncake 110% 6%
            // higher (BENCHMARKS, "A prompt's delay to the requests it joins").
            pending_weight: 0.5,
            // vLLM's default for online serving on H100-class GPUs; without the bound the
            // charge cost the Mooncake trace (half its prompts over 8,192 tokens) 6% of TTFT
            // p95 at 110% load (BENCHMARKS, "One step of a long prompt").
            max_num_batched_tokens: 8192,
            progress_credit: 0.5,
            // Per token, the dense layers cost 2 × params FLOPs and attention 4 × layers ×
            // hidden size × position: equal at params / (2 × layers × hidden). Llama-3.1-8B:
            // 8.0e9 / (2 × 32 × 4096) ≈ 30.6k; 70B: 53k.
            attention_tokens: 30_000.0,
            first_token_steps: 1.5,
        }
    }
}

impl Default for RawWeighted {
    fn default() -> Self {
        // The Gateway API Inference Extension's defaults: queue 2, kv-cache 2, prefix 3.
        Self {
            queue: 2.0,
            kv: 2.0,
            prefix: 3.0,
        }
    }
}

impl Default for RawOverload {
    fn default() -> Self {
        Self {
            queue_limit: 128,
            kv_limit: 0.95,
            retry_after_s: 1,
            refused_ms: 0,
            hold: RawHold::default(),
        }
    }
}

impl Default for RawHold {
    fn default() -> Self {
        Self {
            max_wait_ms: 0,
            wait_limit_ms: 1000,
            max_requests: 1024,
            priority_weight: 4.0,
            newest_first_after_ms: 0,
            objective_wait_share: 0.0,
        }
    }
}

impl Default for RawShare {
    fn default() -> Self {
        Self {
            workers: true,
            tick_ms: 2,
            peer_timeout_ms: 5000,
            on_request: true,
            // Replay, 16 workers, 15 runs: TTFT p95 58 / 29 / 123 ms on shared-prefix /
            // multi-turn / rag at 80% against 58 / 28 / 122 publishing every decision, while
            // workers read a segment per tick instead of one per peer decision.
            hits_on_tick: true,
            replicas: None,
        }
    }
}

impl Default for RawIndex {
    fn default() -> Self {
        Self {
            // For the whole Envoy process: workers that share a view split it (each keeps a copy).
            max_memory_bytes: 256 << 20,
            default_capacity_tokens: 400_000,
            learn_from_usage: true,
        }
    }
}
