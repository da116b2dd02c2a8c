//! GPU × model profiles and the step-time model (DESIGN §6).
//!
//! `T_step = T_fixed + max(T_weights + T_kv_read, c_lin · N_tokens) + T_attention + T_tp`:
//! a step is bound by reading the weights and the KV cache from HBM (decode) or by the
//! matmuls over the batch's new tokens (prefill), plus attention over the context and the
//! tensor-parallel all-reduces. Constants are calibrated to published reference points
//! (within about ±20%): Llama-3-8B on one H100 decodes a token in 7–8 ms at batch 1 and
//! prefills 8k tokens in about 210 ms; on one A100-80GB 11.5–12 ms and about 12k tokens/s;
//! Llama-3-70B with TP4 on H100 decodes in 17.5–19.5 ms. KV capacity follows vLLM: 0.92 of
//! HBM minus weights and activations, in 16-token blocks (8B bf16: 2 MiB a block, about
//! 29k blocks on an 80 GB H100, as vLLM 0.33 reports in `vllm:cache_config_info`).

use std::fmt;

pub const BLOCK_TOKENS: u64 = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Gpu {
    #[value(name = "a100-80g")]
    A100_80g,
    #[value(name = "h100-80g")]
    H100_80g,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Model {
    #[value(name = "llama-3.1-8b")]
    Llama31_8b,
    #[value(name = "llama-3.1-70b")]
    Llama31_70b,
}

impl Model {
    pub fn served_name(self) -> &'static str {
        match self {
            Model::Llama31_8b => "meta-llama/Llama-3.1-8B-Instruct",
            Model::Llama31_70b => "meta-llama/Llama-3.1-70B-Instruct",
        }
    }
    fn params_b(self) -> f64 {
        match self {
            Model::Llama31_8b => 8.03,
            Model::Llama31_70b => 70.6,
        }
    }
    /// K and V bytes per token over all layers (bf16, GQA with 8 KV heads of 128).
    fn kv_bytes_per_token(self) -> f64 {
        let layers = match self {
            Model::Llama31_8b => 32.0,
            Model::Llama31_70b => 80.0,
        };
        2.0 * layers * 8.0 * 128.0 * 2.0
    }
    fn layers(self) -> f64 {
        match self {
            Model::Llama31_8b => 32.0,
            Model::Llama31_70b => 80.0,
        }
    }
}

impl fmt::Display for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.served_name())
    }
}

/// One simulated server's hardware and engine settings, with derived constants.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Profile {
    pub gpu: Gpu,
    pub model: Model,
    pub tp: u32,
    pub num_gpu_blocks: u64,
    pub max_num_batched_tokens: u64,
    pub max_num_seqs: usize,
    /// Blocks become prefix-cache hits when a step is planned that computes them, as vLLM
    /// V1 caches them (`allocate_slots` → `cache_blocks`, before the forward pass: a request
    /// admitted in the same step as a sibling hits the sibling's chunk). On by default; off
    /// (`--cache-at-finish`): when the step ends, the model of the figures published before
    /// 2026-11-28.
    pub cache_at_schedule: bool,
    /// ms
    t_fixed: f64,
    t_weights: f64,
    /// ms per KV byte read per GPU
    kv_read_ms_per_byte: f64,
    /// ms per new token (matmul-bound part)
    c_lin: f64,
    /// ms per (new token × context token) of attention
    c_attn: f64,
    /// ms of all-reduce per step
    t_tp: f64,
    kv_bytes_per_token_per_gpu: f64,
}

impl Profile {
    pub fn new(gpu: Gpu, model: Model, tp: u32) -> anyhow::Result<Profile> {
        anyhow::ensure!([1, 2, 4, 8].contains(&tp), "--tp must be 1, 2, 4 or 8 (got {tp})");
        let (hbm_gib, bw_bytes_per_ms, flops_per_ms, fixed) = match gpu {
            // Effective (not peak) bandwidth and dense bf16 throughput, per GPU.
            Gpu::H100_80g => (80.0, 3.35e9, 0.82e12, 2.5),
            Gpu::A100_80g => (80.0, 2.0e9, 0.245e12, 3.5),
        };
        let tpf = f64::from(tp);
        let weight_bytes = model.params_b() * 1e9 * 2.0 / tpf;
        anyhow::ensure!(
            weight_bytes < 0.92 * hbm_gib * 1073741824.0 * 0.9,
            "{model} does not fit on {tp} × {gpu:?}: use a larger --tp"
        );
        let kv_per_token = model.kv_bytes_per_token() / tpf;
        let usable = 0.92 * hbm_gib * 1073741824.0 - weight_bytes - 1.6e9;
        let num_gpu_blocks = (usable / (kv_per_token * BLOCK_TOKENS as f64)).max(16.0) as u64;
        // 2 FLOPs per parameter per token, split over the TP group.
        let c_lin = 2.0 * model.params_b() * 1e9 / tpf / flops_per_ms;
        // Attention: 4 · layers · d_model(≈ heads·128) FLOPs per (new, context) token pair.
        let d_model = match model {
            Model::Llama31_8b => 4096.0,
            Model::Llama31_70b => 8192.0,
        };
        let c_attn = 4.0 * model.layers() * d_model / tpf / (flops_per_ms * 0.45);
        let t_tp = if tp > 1 { model.layers() * 2.0 * 0.028 } else { 0.0 };
        let (max_num_batched_tokens, max_num_seqs) = match gpu {
            Gpu::H100_80g => (8192, 1024),
            Gpu::A100_80g => (2048, 256),
        };
        Ok(Profile {
            gpu,
            model,
            tp,
            num_gpu_blocks,
            max_num_batched_tokens,
            max_num_seqs,
            cache_at_schedule: true,
            t_fixed: fixed,
            t_weights: weight_bytes / bw_bytes_per_ms,
            kv_read_ms_per_byte: 1.0 / bw_bytes_per_ms,
            c_lin,
            c_attn,
            t_tp,
            kv_bytes_per_token_per_gpu: kv_per_token,
        })
    }

    /// Caches blocks when their step is planned (see `cache_at_schedule`).
    pub fn with_cache_at_schedule(mut self, on: bool) -> Profile {
        self.cache_at_schedule = on;
        self
    }

    /// Overrides the KV size (tests and small fleets).
    pub fn with_blocks(mut self, blocks: u64) -> Profile {
        self.num_gpu_blocks = blocks.max(2);
        self
    }

    /// Duration in ms of one step that computes `new_tokens` new tokens whose attention
    /// spans `attn_pairs` (new × context) token pairs, reading `context_tokens` of KV.
    pub fn step_ms(&self, new_tokens: u64, attn_pairs: f64, context_tokens: u64) -> f64 {
        let kv_read = context_tokens as f64 * self.kv_bytes_per_token_per_gpu * self.kv_read_ms_per_byte;
        let memory = self.t_weights + kv_read;
        let compute = self.c_lin * new_tokens as f64;
        self.t_fixed + memory.max(compute) + self.c_attn * attn_pairs + self.t_tp
    }

    /// Prefill throughput of a long prompt alone, tokens per second (for capacity estimates).
    pub fn prefill_tokens_per_s(&self, prompt: u64) -> f64 {
        let mut t = 0.0;
        let mut done = 0;
        while done < prompt {
            let n = (prompt - done).min(self.max_num_batched_tokens);
            let pairs = n as f64 * (done as f64 + n as f64 / 2.0);
            t += self.step_ms(n, pairs, done + n);
            done += n;
        }
        prompt as f64 / (t / 1000.0)
    }
}

/// A mixed fleet from `COUNTxGPU:MODEL[:tpN][:seqsN],...` (e.g.
/// `4xh100-80g:llama-3.1-8b,4xa100-80g:llama-3.1-8b,2xh100-80g:llama-3.1-70b:tp4`): one
/// profile per server, in the order given. `seqsN` sets the servers' sequence slots (vLLM's
/// `--max-num-seqs`; by default 256 on an A100, 1024 on an H100): fewer slots fill at the
/// request rates a small machine can drive live.
pub fn parse_fleet(spec: &str) -> anyhow::Result<Vec<Profile>> {
    use clap::ValueEnum;
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = |why: &str| anyhow::anyhow!("--fleet {part:?}: {why} (expected COUNTxGPU:MODEL[:tpN][:seqsN])");
        let (count, rest) = part.split_once('x').ok_or_else(|| bad("no COUNTx"))?;
        let count: usize = count.parse().map_err(|_| bad("COUNT is not a number"))?;
        let mut fields = rest.split(':');
        let gpu = Gpu::from_str(fields.next().unwrap_or(""), true).map_err(|e| bad(&e))?;
        let model = Model::from_str(fields.next().ok_or_else(|| bad("no MODEL"))?, true).map_err(|e| bad(&e))?;
        let (mut tp, mut seqs) = (None, None);
        for field in fields {
            let number = |prefix: &str| field.strip_prefix(prefix).map(|n| n.parse::<u64>().ok());
            match (number("tp"), number("seqs")) {
                (Some(Some(n)), _) if tp.is_none() => tp = Some(n),
                (_, Some(Some(n))) if seqs.is_none() && n >= 1 => seqs = Some(n),
                (Some(_), _) => return Err(bad("TP must read tpN, once")),
                (_, Some(_)) => return Err(bad("the sequence slots must read seqsN (N ≥ 1), once")),
                _ => return Err(bad(&format!("unknown field {field:?}"))),
            }
        }
        anyhow::ensure!(count >= 1, "--fleet {part:?}: COUNT must be at least 1");
        let tp = u32::try_from(tp.unwrap_or(1)).map_err(|_| bad("TP is too large"))?;
        let mut profile = Profile::new(gpu, model, tp).map_err(|e| bad(&e.to_string()))?;
        if let Some(n) = seqs {
            profile.max_num_seqs = usize::try_from(n).map_err(|_| bad("too many sequence slots"))?;
        }
        out.extend(std::iter::repeat_n(profile, count));
    }
    anyhow::ensure!(!out.is_empty(), "--fleet {spec:?} names no servers");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn within(value: f64, lo: f64, hi: f64) -> bool {
        (lo * 0.75..=hi * 1.25).contains(&value)
    }

    #[test]
    fn llama_8b_on_h100_matches_published_reference_points() {
        let p = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
        let decode = p.step_ms(1, 1000.0, 1000);
        assert!(within(decode, 7.0, 8.0), "decode {decode} ms");
        let prefill_8k: f64 = 8192.0 / p.prefill_tokens_per_s(8192) * 1000.0;
        assert!(within(prefill_8k, 210.0, 210.0), "8k prefill {prefill_8k} ms");
        assert!(
            within(p.num_gpu_blocks as f64, 28_000.0, 29_205.0),
            "{} blocks",
            p.num_gpu_blocks
        );
        assert_eq!((p.max_num_batched_tokens, p.max_num_seqs), (8192, 1024));
    }

    #[test]
    fn llama_8b_on_a100_matches_published_reference_points() {
        let p = Profile::new(Gpu::A100_80g, Model::Llama31_8b, 1).unwrap();
        let decode = p.step_ms(1, 1000.0, 1000);
        assert!(within(decode, 11.5, 12.0), "decode {decode} ms");
        let rate = p.prefill_tokens_per_s(8192);
        assert!(within(rate, 12_000.0, 12_000.0), "prefill {rate} tok/s");
        assert_eq!((p.max_num_batched_tokens, p.max_num_seqs), (2048, 256));
    }

    #[test]
    fn llama_70b_tp4_on_h100_matches_published_reference_points() {
        let p = Profile::new(Gpu::H100_80g, Model::Llama31_70b, 4).unwrap();
        let decode = p.step_ms(1, 1000.0, 1000);
        assert!(within(decode, 17.5, 19.5), "decode {decode} ms");
        assert!(
            Profile::new(Gpu::H100_80g, Model::Llama31_70b, 1).is_err(),
            "70B does not fit one GPU"
        );
    }

    #[test]
    fn bigger_batches_cost_more_per_step_but_less_per_token() {
        let p = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
        let one = p.step_ms(1, 500.0, 500);
        let many = p.step_ms(64, 64.0 * 500.0, 64 * 500);
        assert!(many > one && many / 64.0 < one);
    }

    #[test]
    fn a_mixed_fleet_spec_gives_one_profile_per_server_in_order() {
        let fleet = parse_fleet("2xh100-80g:llama-3.1-8b, 1xa100-80g:llama-3.1-70b:tp4").unwrap();
        let got: Vec<(Gpu, Model, u32)> = fleet.iter().map(|p| (p.gpu, p.model, p.tp)).collect();
        assert_eq!(
            got,
            vec![
                (Gpu::H100_80g, Model::Llama31_8b, 1),
                (Gpu::H100_80g, Model::Llama31_8b, 1),
                (Gpu::A100_80g, Model::Llama31_70b, 4)
            ]
        );
        for bad in [
            "",
            "h100-80g:llama-3.1-8b",
            "2xh100:llama-3.1-8b",
            "2xh100-80g",
            "2xh100-80g:llama-3.1-8b:4",
            "0xh100-80g:llama-3.1-8b",
            "2xh100-80g:llama-3.1-8b:seqs0",
            "2xh100-80g:llama-3.1-8b:seqs48:seqs64",
            "2xh100-80g:llama-3.1-8b:tp2:tp4",
            "2xh100-80g:llama-3.1-8b:slots48",
        ] {
            assert!(parse_fleet(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_fleet_spec_may_set_the_sequence_slots() {
        let fleet = parse_fleet("1xa100-80g:llama-3.1-8b:seqs48,1xh100-80g:llama-3.1-70b:seqs64:tp2").unwrap();
        let got: Vec<(u32, usize)> = fleet.iter().map(|p| (p.tp, p.max_num_seqs)).collect();
        assert_eq!(got, vec![(1, 48), (2, 64)]);
        let default = parse_fleet("1xa100-80g:llama-3.1-8b").unwrap();
        assert_eq!(default[0].max_num_seqs, 256, "vLLM's default on an A100");
    }
}
