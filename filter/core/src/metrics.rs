//! vLLM's `/metrics` body → the load and cache facts the router scores with.
//!
//! Families read (vLLM ≥ 0.12 names first, the legacy pre-0.12 name second):
//! `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc`), `vllm:num_requests_running`,
//! `vllm:num_requests_waiting`, `vllm:cache_config_info` (`block_size`, `num_gpu_blocks`),
//! `vllm:prefix_cache_{queries,hits}_total` (`vllm:gpu_prefix_cache_{queries,hits}_total`),
//! `vllm:lora_requests_info` (the series with the largest value, a timestamp, wins).
//! A server running several engines labels each series with `engine`; counts are summed,
//! KV usage is averaged weighted by each engine's `num_gpu_blocks` (plain mean when unknown).
//! Everything else is skipped unread. A missing required family is an error, never a guess.

use std::collections::BTreeMap;
use std::fmt;

use crate::prometheus::{parse_sample, sample_name, LineError, Sample};

/// Distinct `engine` label values accepted in one body (bounds memory on hostile input).
pub const MAX_ENGINES: usize = 64;
const MAX_MODELS: usize = 16;
/// Adapter names kept from one `running_lora_adapters` / `waiting_lora_adapters` label.
const MAX_ADAPTERS: usize = 64;

/// The LoRA adapters a server reports, from the newest `vllm:lora_requests_info` series.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoraInfo {
    pub max_lora: u32,
    pub running: Vec<String>,
    pub waiting: Vec<String>,
}

/// What one scrape of one server says.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VllmMetrics {
    /// Fraction of KV blocks in use, 0..=1.
    pub kv_usage: f64,
    pub running: u64,
    pub waiting: u64,
    pub block_size: Option<u32>,
    pub num_gpu_blocks: Option<u64>,
    pub prefix_queries: Option<f64>,
    pub prefix_hits: Option<f64>,
    pub lora: Option<LoraInfo>,
    /// `model_name` label values seen on the request gauges.
    pub models: Vec<String>,
    pub engines: u32,
    /// True when only the pre-0.12 family names were found.
    pub legacy_names: bool,
    /// Since the server started, summed over finished requests: seconds spent in prefill
    /// (`vllm:request_prefill_time_seconds_sum`) and prompt tokens computed there, cached
    /// ones excluded (`vllm:request_prefill_kv_computed_tokens_sum`): the server's own
    /// prefill speed (see `speed`).
    pub prefill_seconds: Option<f64>,
    pub prefill_computed_tokens: Option<f64>,
    /// Since the server started: the seconds between consecutive output tokens, summed
    /// (`vllm:inter_token_latency_seconds_sum`) and counted (`_count`). vLLM observes them
    /// every step, so their growth between scrapes is the server's recent step time.
    pub itl_seconds: Option<f64>,
    pub itl_count: Option<f64>,
    /// Since the server started: the prompt tokens of its requests, each counted once when
    /// its first token came (`vllm:prompt_tokens_total`, summed over engines and models):
    /// all the traffic it served, whoever sent it (see `seen`).
    pub prompt_tokens: Option<f64>,
    /// Since the server started: its finished requests (`vllm:request_success_total`,
    /// summed over finish reasons, engines and models). Their growth between scrapes is
    /// how fast waiting requests get admitted (see `speed::Completions`).
    pub finished: Option<f64>,
}

impl VllmMetrics {
    /// KV capacity in tokens, when the server exports `vllm:cache_config_info`.
    pub fn capacity_tokens(&self) -> Option<u64> {
        Some(self.num_gpu_blocks?.saturating_mul(u64::from(self.block_size?)))
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetricsError {
    TooLarge { bytes: usize, limit: usize },
    NotUtf8,
    MissingFamily(&'static str),
    InvalidValue { family: &'static str, line: usize },
    Line(LineError),
    TooManyEngines,
}

impl fmt::Display for MetricsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetricsError::TooLarge { bytes, limit } => {
                write!(f, "metrics body is {bytes} bytes, over scrape.max_bytes ({limit})")
            }
            MetricsError::NotUtf8 => f.write_str("metrics body is not UTF-8"),
            MetricsError::MissingFamily(name) => write!(f, "metrics body has no {name} series: is this a vLLM server?"),
            MetricsError::InvalidValue { family, line } => write!(f, "line {line}: {family} has a value out of range"),
            MetricsError::Line(e) => write!(f, "metrics body {e}"),
            MetricsError::TooManyEngines => write!(f, "metrics body names more than {MAX_ENGINES} engines"),
        }
    }
}

impl std::error::Error for MetricsError {}

#[derive(Default)]
struct Engine {
    kv: Option<f64>,
    kv_legacy: Option<f64>,
    running: Option<f64>,
    waiting: Option<f64>,
    block_size: Option<u32>,
    num_gpu_blocks: Option<u64>,
    queries: [Option<f64>; 2],
    hits: [Option<f64>; 2],
}

#[derive(Default)]
struct Acc {
    engines: BTreeMap<String, Engine>,
    prefill_seconds: Option<f64>,
    prefill_tokens: Option<f64>,
    itl_seconds: Option<f64>,
    itl_count: Option<f64>,
    prompt_tokens: Option<f64>,
    finished: Option<f64>,
    lora: Option<(f64, LoraInfo)>,
    models: Vec<String>,
}

const KV: &str = "vllm:kv_cache_usage_perc";
const KV_LEGACY: &str = "vllm:gpu_cache_usage_perc";
const RUNNING: &str = "vllm:num_requests_running";
const WAITING: &str = "vllm:num_requests_waiting";
const PREFILL_SECONDS: &str = "vllm:request_prefill_time_seconds_sum";
const PREFILL_TOKENS: &str = "vllm:request_prefill_kv_computed_tokens_sum";
const ITL_SECONDS: &str = "vllm:inter_token_latency_seconds_sum";
const ITL_COUNT: &str = "vllm:inter_token_latency_seconds_count";
const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
const FINISHED: &str = "vllm:request_success_total";

/// Parses a `/metrics` body of at most `max_bytes` bytes.
pub fn parse_metrics(body: &[u8], max_bytes: usize) -> Result<VllmMetrics, MetricsError> {
    if body.len() > max_bytes {
        return Err(MetricsError::TooLarge {
            bytes: body.len(),
            limit: max_bytes,
        });
    }
    let text = std::str::from_utf8(body).map_err(|_| MetricsError::NotUtf8)?;
    let mut acc = Acc::default();
    for (i, line) in text.lines().enumerate() {
        let Some(name) = sample_name(line) else { continue };
        if !is_wanted(name) {
            continue;
        }
        let sample = parse_sample(line, i + 1).map_err(MetricsError::Line)?;
        acc.add(&sample, i + 1)?;
    }
    acc.finish()
}

fn is_wanted(name: &str) -> bool {
    matches!(
        name,
        KV | KV_LEGACY
            | RUNNING
            | WAITING
            | "vllm:cache_config_info"
            | "vllm:prefix_cache_queries_total"
            | "vllm:prefix_cache_hits_total"
            | "vllm:gpu_prefix_cache_queries_total"
            | "vllm:gpu_prefix_cache_hits_total"
            | "vllm:lora_requests_info"
            | PREFILL_SECONDS
            | PREFILL_TOKENS
            | ITL_SECONDS
            | ITL_COUNT
            | PROMPT_TOKENS
            | FINISHED
    )
}

fn gauge(sample: &Sample, family: &'static str, line: usize, max: f64) -> Result<f64, MetricsError> {
    let v = sample.value;
    if v.is_finite() && (0.0..=max).contains(&v) {
        Ok(v)
    } else {
        Err(MetricsError::InvalidValue { family, line })
    }
}

/// A comma-separated adapter list, at most `MAX_ADAPTERS` names: a server loads a handful
/// (vLLM's `--max-loras`), and a garbage label must not cost every worker memory and every
/// request a scan.
fn split_list(s: Option<&str>) -> Vec<String> {
    s.unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .take(MAX_ADAPTERS)
        .map(String::from)
        .collect()
}

impl Acc {
    fn add(&mut self, s: &Sample, line: usize) -> Result<(), MetricsError> {
        // Summed over engines and models: the whole server's prefill work and time.
        if s.name == PREFILL_SECONDS {
            *self.prefill_seconds.get_or_insert(0.0) += gauge(s, PREFILL_SECONDS, line, f64::MAX)?;
            return Ok(());
        }
        if s.name == PREFILL_TOKENS {
            *self.prefill_tokens.get_or_insert(0.0) += gauge(s, PREFILL_TOKENS, line, f64::MAX)?;
            return Ok(());
        }
        if s.name == ITL_SECONDS {
            *self.itl_seconds.get_or_insert(0.0) += gauge(s, ITL_SECONDS, line, f64::MAX)?;
            return Ok(());
        }
        if s.name == ITL_COUNT {
            *self.itl_count.get_or_insert(0.0) += gauge(s, ITL_COUNT, line, f64::MAX)?;
            return Ok(());
        }
        if s.name == PROMPT_TOKENS {
            *self.prompt_tokens.get_or_insert(0.0) += gauge(s, PROMPT_TOKENS, line, f64::MAX)?;
            return Ok(());
        }
        if s.name == FINISHED {
            *self.finished.get_or_insert(0.0) += gauge(s, FINISHED, line, f64::MAX)?;
            return Ok(());
        }
        if s.name == "vllm:lora_requests_info" {
            if self.lora.as_ref().is_none_or(|(best, _)| s.value > *best) {
                let info = LoraInfo {
                    max_lora: s.label("max_lora").and_then(|v| v.parse().ok()).unwrap_or(0),
                    running: split_list(s.label("running_lora_adapters")),
                    waiting: split_list(s.label("waiting_lora_adapters")),
                };
                self.lora = Some((s.value, info));
            }
            return Ok(());
        }
        if let Some(model) = s.label("model_name") {
            if (s.name == RUNNING || s.name == WAITING)
                && self.models.len() < MAX_MODELS
                && !self.models.iter().any(|m| m == model)
            {
                self.models.push(model.to_string());
            }
        }
        let key = s.label("engine").unwrap_or("").to_string();
        if !self.engines.contains_key(&key) && self.engines.len() >= MAX_ENGINES {
            return Err(MetricsError::TooManyEngines);
        }
        let e = self.engines.entry(key).or_default();
        const COUNT_MAX: f64 = 1e12;
        match s.name {
            KV => e.kv = Some(gauge(s, KV, line, 1.0)?),
            KV_LEGACY => e.kv_legacy = Some(gauge(s, KV_LEGACY, line, 1.0)?),
            // Several series per engine (e.g. one per model_name) add up.
            RUNNING => *e.running.get_or_insert(0.0) += gauge(s, RUNNING, line, COUNT_MAX)?,
            WAITING => *e.waiting.get_or_insert(0.0) += gauge(s, WAITING, line, COUNT_MAX)?,
            "vllm:cache_config_info" => {
                e.block_size = s.label("block_size").and_then(|v| v.parse().ok()).filter(|b| *b > 0);
                e.num_gpu_blocks = s.label("num_gpu_blocks").and_then(|v| v.parse().ok());
            }
            "vllm:prefix_cache_queries_total" => {
                e.queries[0] = Some(gauge(s, "vllm:prefix_cache_queries_total", line, f64::MAX)?)
            }
            "vllm:prefix_cache_hits_total" => {
                e.hits[0] = Some(gauge(s, "vllm:prefix_cache_hits_total", line, f64::MAX)?)
            }
            "vllm:gpu_prefix_cache_queries_total" => {
                e.queries[1] = Some(gauge(s, "vllm:gpu_prefix_cache_queries_total", line, f64::MAX)?)
            }
            "vllm:gpu_prefix_cache_hits_total" => {
                e.hits[1] = Some(gauge(s, "vllm:gpu_prefix_cache_hits_total", line, f64::MAX)?)
            }
            _ => {}
        }
        Ok(())
    }

    fn finish(self) -> Result<VllmMetrics, MetricsError> {
        let mut out = VllmMetrics {
            models: self.models,
            lora: self.lora.map(|(_, l)| l),
            prefill_seconds: self.prefill_seconds,
            prefill_computed_tokens: self.prefill_tokens,
            itl_seconds: self.itl_seconds,
            itl_count: self.itl_count,
            prompt_tokens: self.prompt_tokens,
            finished: self.finished,
            ..VllmMetrics::default()
        };
        let (mut kv_weighted, mut kv_weight, mut any_current, mut any_legacy) = (0.0, 0.0, false, false);
        let (mut block_size, mut blocks_total, mut blocks_known) = (None, 0u64, true);
        for e in self.engines.values() {
            if e.kv.is_none() && e.kv_legacy.is_none() && e.running.is_none() && e.waiting.is_none() {
                continue; // an engine with only info series (e.g. no engine label on cache config)
            }
            let kv = match (e.kv, e.kv_legacy) {
                (Some(v), _) => {
                    any_current = true;
                    v
                }
                (None, Some(v)) => {
                    any_legacy = true;
                    v
                }
                (None, None) => return Err(MetricsError::MissingFamily(KV)),
            };
            out.running += e.running.ok_or(MetricsError::MissingFamily(RUNNING))? as u64;
            out.waiting += e.waiting.ok_or(MetricsError::MissingFamily(WAITING))? as u64;
            let weight = e.num_gpu_blocks.map_or(1.0, |b| b as f64);
            kv_weighted += kv * weight;
            kv_weight += weight;
            out.engines += 1;
            block_size = block_size.or(e.block_size);
            match e.num_gpu_blocks {
                Some(b) => blocks_total = blocks_total.saturating_add(b),
                None => blocks_known = false,
            }
            out.prefix_queries = sum_opt(out.prefix_queries, e.queries[0].or(e.queries[1]));
            out.prefix_hits = sum_opt(out.prefix_hits, e.hits[0].or(e.hits[1]));
        }
        if out.engines == 0 {
            return Err(MetricsError::MissingFamily(KV));
        }
        // cache_config_info without an engine label describes every engine alike.
        if let Some(shared) = self
            .engines
            .get("")
            .filter(|e| e.num_gpu_blocks.is_some() && e.kv.is_none() && e.kv_legacy.is_none())
        {
            block_size = block_size.or(shared.block_size);
            blocks_total = shared
                .num_gpu_blocks
                .unwrap_or(0)
                .saturating_mul(u64::from(out.engines));
            blocks_known = true;
        }
        out.kv_usage = if kv_weight > 0.0 { kv_weighted / kv_weight } else { 0.0 };
        out.block_size = block_size;
        out.num_gpu_blocks = (blocks_known && blocks_total > 0).then_some(blocks_total);
        out.legacy_names = any_legacy && !any_current;
        Ok(out)
    }
}

fn sum_opt(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
    }
}

#[cfg(test)]
mod tests;
