//! `/metrics` exactly as vLLM 0.33 prints it (family names, help texts, labels, bucket
//! bounds, `_created` gauges and the Python client's float formatting), for the families a
//! router reads, the latency histograms (inter-token latency observed per token, as vLLM
//! does) and the per-request histograms tools read (token counts, tokens per engine step,
//! queue / prefill / decode / inference times); `legacy` switches to the pre-0.12 names
//! (`vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_*`, no `engine` label). Not exported:
//! the request-parameter histograms (`request_params_n`, `request_params_max_tokens`,
//! `request_max_num_generation_tokens`: the engine sees sequences, not API requests).

use std::fmt::Write;

mod v033;

/// A Prometheus histogram with fixed upper bounds (cumulative counts are built on render).
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

pub const TTFT_BOUNDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
pub const ITL_BOUNDS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
pub const E2E_BOUNDS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];

/// Token-count buckets (`request_prompt_tokens`, `request_generation_tokens`, …).
pub const TOKEN_BOUNDS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0, 100000.0,
];
/// Tokens per engine step, up to twice `max_num_batched_tokens` (8192 on H100).
pub const ITERATION_BOUNDS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];

/// `vllm:request_num_preemptions`: how many times a request was preempted.
pub const PREEMPTION_BOUNDS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0];

/// The per-request and per-step histograms, observed by the engine.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestHistograms {
    pub prompt_tokens: Histogram,
    pub generation_tokens: Histogram,
    pub iteration_tokens: Histogram,
    pub time_per_output_token: Histogram,
    pub queue: Histogram,
    pub inference: Histogram,
    pub prefill: Histogram,
    pub decode: Histogram,
    pub num_preemptions: Histogram,
    pub prefill_kv_computed: Histogram,
}

impl Default for RequestHistograms {
    fn default() -> Self {
        RequestHistograms {
            prompt_tokens: Histogram::new(TOKEN_BOUNDS),
            generation_tokens: Histogram::new(TOKEN_BOUNDS),
            iteration_tokens: Histogram::new(ITERATION_BOUNDS),
            time_per_output_token: Histogram::new(ITL_BOUNDS),
            queue: Histogram::new(E2E_BOUNDS),
            inference: Histogram::new(E2E_BOUNDS),
            prefill: Histogram::new(E2E_BOUNDS),
            decode: Histogram::new(E2E_BOUNDS),
            num_preemptions: Histogram::new(PREEMPTION_BOUNDS),
            prefill_kv_computed: Histogram::new(TOKEN_BOUNDS),
        }
    }
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        let i = self.bounds.iter().position(|b| v <= *b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }
}

/// What a server exports at one instant.
pub struct View<'a> {
    pub model: &'a str,
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    pub finished: u64,
    pub finished_stop: u64,
    pub aborted: u64,
    /// By reason: `max_num_queued_reqs`, `max_num_queued_tokens`.
    pub admission_rejected: [u64; 2],
    pub num_gpu_blocks: u64,
    pub ttft: &'a Histogram,
    pub itl: &'a Histogram,
    pub e2e: &'a Histogram,
    pub requests: &'a RequestHistograms,
    /// Process start time (s since the epoch) for the `_created` gauges.
    pub created: f64,
}

/// Python prometheus_client's `floatToGoString`.
pub fn go_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "+Inf".into() } else { "-Inf".into() };
    }
    let mut s = format!("{v}");
    if !s.contains('.') && !s.contains('e') {
        s.push_str(".0");
    }
    match s.find('.') {
        Some(dot) if v > 0.0 && dot > 6 => {
            let digits = format!("{}{}", &s[1..dot], &s[dot + 1..]);
            let mantissa = format!("{}.{}", &s[..1], digits)
                .trim_end_matches('0')
                .trim_end_matches('.')
                .to_string();
            format!("{mantissa}e+0{}", dot - 1)
        }
        _ => s,
    }
}

struct Out<'a> {
    text: String,
    labels: String,
    created: &'a str,
}

impl Out<'_> {
    fn family(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }
    fn sample(&mut self, name: &str, extra: &str, v: f64) {
        let labels = if extra.is_empty() {
            self.labels.clone()
        } else {
            format!("{extra},{}", self.labels)
        };
        let labels = labels.trim_end_matches(',');
        if labels.is_empty() {
            let _ = writeln!(self.text, "{name} {}", go_float(v));
        } else {
            let _ = writeln!(self.text, "{name}{{{labels}}} {}", go_float(v));
        }
    }
    fn counter(&mut self, base: &str, help: &str, v: f64) {
        self.family(&format!("{base}_total"), help, "counter");
        self.sample(&format!("{base}_total"), "", v);
        self.family(&format!("{base}_created"), help, "gauge");
        let created: f64 = self.created.parse().unwrap_or(0.0);
        self.sample(&format!("{base}_created"), "", created);
    }
    fn histogram(&mut self, base: &str, help: &str, h: &Histogram) {
        self.family(base, help, "histogram");
        let mut cumulative = 0;
        for (i, b) in h.bounds.iter().enumerate() {
            cumulative += h.counts[i];
            self.bucket(base, &go_float(*b), cumulative);
        }
        cumulative += h.counts[h.bounds.len()];
        self.bucket(base, "+Inf", cumulative);
        self.sample(&format!("{base}_count"), "", h.count as f64);
        self.sample(&format!("{base}_sum"), "", h.sum);
        self.family(&format!("{base}_created"), help, "gauge");
        let created: f64 = self.created.parse().unwrap_or(0.0);
        self.sample(&format!("{base}_created"), "", created);
    }
    fn bucket(&mut self, base: &str, le: &str, n: u64) {
        // vLLM sorts labels: engine, le, model_name.
        let line = if self.labels.starts_with("engine=") {
            let (engine, model) = self.labels.split_once(',').unwrap_or((&self.labels, ""));
            format!("{base}_bucket{{{engine},le=\"{le}\",{model}}} {}", go_float(n as f64))
        } else {
            format!("{base}_bucket{{le=\"{le}\",{}}} {}", self.labels, go_float(n as f64))
        };
        self.text.push_str(&line);
        self.text.push('\n');
    }
}

pub fn render(v: &View, legacy: bool) -> String {
    let created = go_float(v.created);
    let labels = if legacy {
        format!("model_name=\"{}\"", v.model)
    } else {
        format!("engine=\"0\",model_name=\"{}\"", v.model)
    };
    let mut o = Out {
        text: String::with_capacity(8192),
        labels,
        created: &created,
    };
    o.family(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        "gauge",
    );
    o.sample("vllm:num_requests_running", "", v.running as f64);
    o.family(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        "gauge",
    );
    o.sample("vllm:num_requests_waiting", "", v.waiting as f64);
    if !legacy {
        v033::waiting_and_sleep(&mut o, v);
    }
    if legacy {
        o.family(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage.",
            "gauge",
        );
        o.sample("vllm:gpu_cache_usage_perc", "", v.kv_usage);
        o.counter(
            "vllm:gpu_prefix_cache_queries",
            "GPU prefix cache queries, in terms of number of queried tokens.",
            v.prefix_queries as f64,
        );
        o.counter(
            "vllm:gpu_prefix_cache_hits",
            "GPU prefix cache hits, in terms of number of cached tokens.",
            v.prefix_hits as f64,
        );
    } else {
        o.family(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            "gauge",
        );
        o.sample("vllm:kv_cache_usage_perc", "", v.kv_usage);
        o.counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            v.prefix_queries as f64,
        );
        o.counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            v.prefix_hits as f64,
        );
        v033::other_caches(&mut o);
    }
    o.counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        v.preemptions as f64,
    );
    o.counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        v.prompt_tokens as f64,
    );
    if !legacy {
        v033::prompt_tokens_by_source(&mut o, v);
    }
    o.counter(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        v.prefix_hits as f64,
    );
    if !legacy {
        v033::cached_by_source(&mut o, v);
    }
    o.counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        v.generation_tokens as f64,
    );
    o.family(
        "vllm:request_success_total",
        "Count of successfully processed requests.",
        "counter",
    );
    for reason in ["stop", "length", "abort", "error", "repetition"] {
        let n = match reason {
            "stop" => v.finished_stop,
            "length" => v.finished - v.finished_stop,
            "abort" => v.aborted,
            _ => 0,
        };
        let labels = if legacy {
            format!("finished_reason=\"{reason}\",model_name=\"{}\"", v.model)
        } else {
            format!("engine=\"0\",finished_reason=\"{reason}\",model_name=\"{}\"", v.model)
        };
        let _ = writeln!(o.text, "vllm:request_success_total{{{labels}}} {}", go_float(n as f64));
    }
    if !legacy {
        v033::success_created(&mut o);
        v033::admission_rejections(&mut o, v);
    }
    let r = v.requests;
    for (name, help, h) in [
        (
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            &r.prompt_tokens,
        ),
        (
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            &r.generation_tokens,
        ),
        (
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            &r.iteration_tokens,
        ),
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            v.ttft,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            v.itl,
        ),
        (
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            &r.time_per_output_token,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            v.e2e,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            &r.queue,
        ),
        (
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            &r.inference,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            &r.prefill,
        ),
        (
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            &r.decode,
        ),
        (
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            &r.num_preemptions,
        ),
        (
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            &r.prefill_kv_computed,
        ),
    ] {
        o.histogram(name, help, h);
    }
    o.family(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        "gauge",
    );
    if legacy {
        let _ = writeln!(
            o.text,
            "vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",gpu_memory_utilization=\"0.92\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"sha256\"}} 1.0",
            v.num_gpu_blocks
        );
    } else {
        cache_config_info(&mut o.text, v.num_gpu_blocks);
    }
    o.text
}

/// vLLM 0.33's `cache_config_info` series: every label it prints, in its order, with this
/// server's KV size (the other values are vLLM's defaults for a Llama 3.1 8B server).
fn cache_config_info(text: &mut String, num_gpu_blocks: u64) {
    let tokens = num_gpu_blocks * crate::profile::BLOCK_TOKENS;
    let max_model_len = crate::serve::max_model_len(num_gpu_blocks).max(1);
    let concurrency = python_float3(tokens as f64 / max_model_len as f64);
    let _ = writeln!(
        text,
        "vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",cache_hit_alignment_tokens=\"16\",\
effective_attention_block_size=\"16\",enable_mamba_shared_prefix_checkpoint=\"False\",enable_prefix_caching=\"True\",\
engine=\"0\",gpu_memory_utilization=\"0.92\",hash_block_size=\"16\",is_attention_free=\"False\",\
kv_cache_dtype_skip_layers=\"[]\",kv_cache_layout=\"NHD\",kv_cache_max_concurrency=\"{concurrency}\",\
kv_cache_memory_bytes=\"None\",kv_cache_size_tokens=\"{tokens}\",kv_offloading_backend=\"native\",\
kv_offloading_size=\"None\",kv_sharing_fast_prefill=\"False\",mamba_block_size=\"None\",mamba_cache_dtype=\"auto\",\
mamba_cache_mode=\"none\",mamba_page_size_padded=\"None\",mamba_ssm_cache_dtype=\"auto\",num_cpu_blocks=\"None\",\
num_gpu_blocks=\"{num_gpu_blocks}\",num_gpu_blocks_override=\"None\",prefix_cache_retention_interval=\"0\",\
prefix_caching_hash_algo=\"sha256\",prefix_match_unit=\"16\",replayssm_buffer_len=\"16\",\
simple_cpu_offload_num_blocks=\"None\",skip_page_size_padded=\"None\",sliding_window=\"None\",\
swa_bounded_replay=\"True\",use_kda_recoverssm=\"False\",use_replayssm=\"False\",\
user_specified_block_size=\"False\"}} 1.0"
    );
}

/// `x` rounded to 3 decimals as Python prints it (`3.565`, `4.0`).
fn python_float3(x: f64) -> String {
    let fixed = format!("{x:.3}");
    let trimmed = fixed.trim_end_matches('0');
    if trimmed.ends_with('.') {
        format!("{trimmed}0")
    } else {
        trimmed.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(h: &'a Histogram, r: &'a RequestHistograms) -> View<'a> {
        View {
            model: "meta-llama/Llama-3.1-8B-Instruct",
            running: 12,
            waiting: 3,
            kv_usage: 0.4137,
            prompt_tokens: 493_292,
            generation_tokens: 80_037,
            prefix_queries: 493_292,
            prefix_hits: 315_392,
            preemptions: 0,
            finished: 480,
            finished_stop: 0,
            aborted: 0,
            admission_rejected: [0; 2],
            num_gpu_blocks: 29_205,
            ttft: h,
            itl: h,
            e2e: h,
            requests: r,
            created: 1_795_314_059.139_667_3,
        }
    }

    #[test]
    fn floats_are_formatted_like_the_python_client() {
        assert_eq!(go_float(12.0), "12.0");
        assert_eq!(go_float(493_292.0), "493292.0");
        assert_eq!(go_float(0.4137), "0.4137");
        assert_eq!(go_float(1.795_314_059_139_667_3e9), "1.7953140591396673e+09");
        assert_eq!(go_float(f64::INFINITY), "+Inf");
    }

    #[test]
    fn lines_match_the_vllm_reference_body() {
        let reference = include_str!("../../filter/core/tests/fixtures/vllm_metrics_v0.33.txt");
        let h = Histogram::new(TTFT_BOUNDS);
        let r = RequestHistograms::default();
        let text = render(&view(&h, &r), false);
        for line in [
            "vllm:num_requests_running{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 12.0",
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.4137",
            "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 315392.0",
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            "vllm:request_success_total{engine=\"0\",finished_reason=\"abort\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.0",
            "vllm:admission_rejections_total{model_name=\"meta-llama/Llama-3.1-8B-Instruct\",reason=\"max_num_queued_tokens\"} 0.0",
        ] {
            assert!(reference.contains(line), "not in the reference: {line}");
            assert!(text.contains(line), "not rendered: {line}");
        }
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.001\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.0"));
    }

    #[test]
    fn every_exported_family_is_in_the_reference_with_the_same_help_type_and_buckets() {
        let reference = include_str!("../../filter/core/tests/fixtures/vllm_metrics_v0.33.txt");
        let h = Histogram::new(TTFT_BOUNDS);
        let r = RequestHistograms::default();
        let text = render(&view(&h, &r), false);
        for line in text.lines().filter(|l| l.starts_with("# ")) {
            assert!(reference.contains(line), "not in vLLM 0.33's reference: {line}");
        }
        let bucket = |l: &str| l.contains("_bucket{");
        for line in text.lines().filter(|l| bucket(l)) {
            let head = &line[..line.rfind(' ').unwrap()];
            // `ttft`, `itl` and `e2e` share one test histogram here: only their own bounds count.
            if head.contains("time_to_first_token") || head.contains("inter_token") || head.contains("e2e_") {
                continue;
            }
            assert!(reference.contains(head), "bucket not in the reference: {head}");
        }
    }

    #[test]
    fn every_rendered_series_is_one_the_reference_prints() {
        let reference = include_str!("../../filter/core/tests/fixtures/vllm_metrics_v0.33.txt");
        let (h, r) = (Histogram::new(TTFT_BOUNDS), RequestHistograms::default());
        let text = render(&view(&h, &r), false);
        // `ttft`, `itl` and `e2e` share one test histogram here, so their buckets are
        // checked elsewhere.
        let shared = |l: &str| {
            l.contains("_bucket{")
                && (l.contains("time_to_first_token") || l.contains("inter_token") || l.contains("e2e_"))
        };
        for line in text.lines().filter(|l| !l.starts_with('#') && !shared(l)) {
            let series = &line[..line.rfind(' ').unwrap()];
            assert!(
                reference.contains(&format!("{series} ")),
                "not in the reference: {series}"
            );
        }
    }

    #[test]
    fn a_cache_smaller_than_the_context_reports_a_concurrency_of_one() {
        let mut text = String::new();
        cache_config_info(&mut text, 4096); // 65,536 tokens: the context is capped to them
        assert!(text.contains("kv_cache_max_concurrency=\"1.0\",") && text.contains("kv_cache_size_tokens=\"65536\","));
        assert_eq!(python_float3(467_280.0 / 131_072.0), "3.565");
    }

    #[test]
    fn the_core_parser_reads_both_namings() {
        let mut h = Histogram::new(TTFT_BOUNDS);
        h.observe(0.3);
        for legacy in [false, true] {
            let r = RequestHistograms::default();
            let m = kvroute_core::parse_metrics(render(&view(&h, &r), legacy).as_bytes(), 1 << 20).unwrap();
            assert_eq!(
                (m.running, m.waiting, m.num_gpu_blocks, m.legacy_names),
                (12, 3, Some(29_205), legacy)
            );
            assert_eq!(m.prefix_hits, Some(315_392.0));
        }
    }
}
