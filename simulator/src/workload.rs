//! Workloads: traces (Mooncake JSONL with prefix block ids, Azure CSV with lengths) and
//! generators (shared-prefix groups, multi-turn chat, RAG over shared documents), all
//! turned into requests whose prompt is deterministic text built from segments, so the
//! filter's text hashing and the engine's prefix cache see exactly the sharing the workload
//! encodes. Arrival times are in ms; `--rate-scale` divides them.

use std::fmt;

use anyhow::{bail, Context};
use serde::Deserialize;

use crate::tokens::{render, Segment};

/// Mooncake's prefix block: 512 tokens.
pub const MOONCAKE_BLOCK_TOKENS: u64 = 512;

#[derive(Clone, Debug, PartialEq)]
pub struct SimRequest {
    pub arrival_ms: f64,
    pub segments: Vec<Segment>,
    pub output_tokens: u64,
}

impl SimRequest {
    pub fn prompt_text(&self) -> String {
        render(&self.segments)
    }
    pub fn input_tokens(&self) -> u64 {
        self.segments.iter().map(|s| s.tokens).sum()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TraceFormat {
    Mooncake,
    Azure,
    /// What kvroute's traffic capture writes (`parse_capture`).
    Capture,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Generator {
    SharedPrefix,
    MultiTurn,
    Rag,
}

impl fmt::Display for Generator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Generator::SharedPrefix => "shared-prefix",
            Generator::MultiTurn => "multi-turn",
            Generator::Rag => "rag",
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MooncakeLine {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// Seeds of Mooncake block ids live apart from generator seeds.
const MOONCAKE_SEED: u64 = 0x4d4f_4f4e_0000_0000;

/// Parses a Mooncake trace; each hash id becomes a deterministic 512-token block (the last
/// one cut to the request's input length).
pub fn parse_mooncake(text: &str) -> anyhow::Result<Vec<SimRequest>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let l: MooncakeLine = serde_json::from_str(line).with_context(|| format!("mooncake trace line {}", i + 1))?;
        if l.hash_ids.is_empty() || l.input_length == 0 {
            bail!(
                "mooncake trace line {}: a request needs input_length > 0 and hash_ids",
                i + 1
            );
        }
        let needed = l.input_length.div_ceil(MOONCAKE_BLOCK_TOKENS) as usize;
        if needed > l.hash_ids.len() {
            bail!(
                "mooncake trace line {}: {} tokens need {needed} hash ids, got {}",
                i + 1,
                l.input_length,
                l.hash_ids.len()
            );
        }
        let mut left = l.input_length;
        let segments = l.hash_ids[..needed]
            .iter()
            .map(|id| {
                let t = left.min(MOONCAKE_BLOCK_TOKENS);
                left -= t;
                Segment::new(MOONCAKE_SEED ^ id, t)
            })
            .collect();
        out.push(SimRequest {
            arrival_ms: l.timestamp,
            segments,
            output_tokens: l.output_length.max(1),
        });
    }
    Ok(out)
}

/// One line of kvroute's traffic capture (`kvroute_core::capture`): Mooncake's fields, the
/// block size of the ids, and what the gateway saw. Unknown fields are ignored so newer
/// filters' captures still replay.
#[derive(Deserialize)]
struct CapturedLine {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
    block_tokens: u64,
    #[serde(default)]
    usage: bool,
    #[serde(default)]
    status: u16,
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// What a capture held besides its requests.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CaptureNotes {
    pub lines: usize,
    /// Lines left out: the server refused the request (4xx but 429), so nothing was
    /// generated. A 429 (kvroute shed it, or a server's queue was full) is demand and stays.
    pub client_errors: usize,
    /// Lines whose lengths are estimates (the response carried no `usage`).
    pub estimated: usize,
    /// Prompt tokens and reported cached tokens over the lines with `usage`: the hit rate
    /// the live fleet achieved.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl CaptureNotes {
    pub fn live_hit_rate(&self) -> Option<f64> {
        (self.prompt_tokens > 0).then(|| self.cached_tokens as f64 / self.prompt_tokens as f64)
    }
}

/// One line for the operator: what the capture held and the hit rate the live fleet saw.
pub fn describe_capture(n: &CaptureNotes) -> String {
    let live = n.live_hit_rate().map_or("no line reported usage".to_string(), |r| {
        format!("live prefix hit rate {:.1}%", r * 100.0)
    });
    format!(
        "capture: {} lines, {} left out (client errors), {} with estimated lengths (no usage); {live}",
        n.lines, n.client_errors, n.estimated
    )
}

/// Capture hash ids live apart from Mooncake's and the generators' seeds.
const CAPTURE_SEED: u64 = 0x4b56_4341_0000_0000;

/// Parses a capture written by kvroute's filter. Lines come in completion order; requests
/// are replayed in arrival order from the first arrival. Each hash id becomes a
/// `block_tokens` block (the last cut to the prompt), the prompt past the ids (a partial
/// block, or past `hashing.max_blocks`) is text of its own, and a line without `usage` and
/// without `max_tokens` (output 0) gets `unknown_output` tokens.
pub fn parse_capture(text: &str, unknown_output: u64) -> anyhow::Result<(Vec<SimRequest>, CaptureNotes)> {
    let mut notes = CaptureNotes::default();
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let l: CapturedLine = serde_json::from_str(line)
            .with_context(|| format!("capture line {}: not a kvroute capture line", i + 1))?;
        if l.block_tokens == 0 || !l.timestamp.is_finite() {
            bail!(
                "capture line {}: block_tokens must be positive and timestamp a number",
                i + 1
            );
        }
        notes.lines += 1;
        if (400..500).contains(&l.status) && l.status != 429 {
            notes.client_errors += 1;
            continue;
        }
        if l.usage {
            notes.prompt_tokens += l.input_length;
            notes.cached_tokens += l.cached_tokens.unwrap_or(0);
        } else {
            notes.estimated += 1;
        }
        let input = l.input_length.max(1);
        let mut left = input;
        let mut segments: Vec<Segment> = l
            .hash_ids
            .iter()
            .map_while(|id| {
                let t = left.min(l.block_tokens);
                left -= t;
                (t > 0).then(|| Segment::new(CAPTURE_SEED ^ id, t))
            })
            .collect();
        if left > 0 {
            segments.push(Segment::new(CAPTURE_SEED ^ 0xffff_0000_0000 ^ i as u64, left));
        }
        let output = if l.output_length == 0 && !l.usage {
            unknown_output
        } else {
            l.output_length
        };
        out.push(SimRequest {
            arrival_ms: l.timestamp,
            segments,
            output_tokens: output.max(1),
        });
    }
    out.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
    let first = out.first().map_or(0.0, |r| r.arrival_ms);
    for r in &mut out {
        r.arrival_ms -= first;
    }
    Ok((out, notes))
}

/// Parses an Azure LLM inference trace (`TIMESTAMP,ContextTokens,GeneratedTokens`). With
/// `overlay_groups > 0`, request `i` joins group `mix(i) % groups` and the first half of its
/// context (in 64-token steps) is that group's shared text: a prefix structure the trace
/// itself does not record.
pub fn parse_azure(text: &str, overlay_groups: u64, seed: u64) -> anyhow::Result<Vec<SimRequest>> {
    let mut out = Vec::new();
    let mut first: Option<f64> = None;
    for (i, line) in text.lines().enumerate() {
        if i == 0 && line.starts_with("TIMESTAMP") || line.trim().is_empty() {
            continue;
        }
        let mut f = line.split(',');
        let (Some(ts), Some(ctx), Some(gen), None) = (f.next(), f.next(), f.next(), f.next()) else {
            bail!(
                "azure trace line {}: expected TIMESTAMP,ContextTokens,GeneratedTokens",
                i + 1
            );
        };
        let at = parse_timestamp_ms(ts).with_context(|| format!("azure trace line {}", i + 1))?;
        let ctx: u64 = ctx
            .trim()
            .parse()
            .with_context(|| format!("azure trace line {}: ContextTokens", i + 1))?;
        let gen: u64 = gen
            .trim()
            .parse()
            .with_context(|| format!("azure trace line {}: GeneratedTokens", i + 1))?;
        let start = *first.get_or_insert(at);
        let unique = Segment::new(seed ^ 0xa2a2_0000_0000 ^ i as u64, ctx.max(1));
        let segments = if overlay_groups > 0 {
            let group = kvroute_core::policy::mix(seed ^ i as u64) % overlay_groups;
            let shared = (ctx / 2) / 64 * 64;
            let rest = Segment::new(unique.seed, ctx.max(1) - shared);
            vec![Segment::new(seed ^ 0xa2a3_0000_0000 ^ group, shared), rest]
        } else {
            vec![unique]
        };
        out.push(SimRequest {
            arrival_ms: at - start,
            segments,
            output_tokens: gen.max(1),
        });
    }
    Ok(out)
}

/// `YYYY-MM-DD HH:MM:SS[.fraction]` → ms since the epoch.
fn parse_timestamp_ms(ts: &str) -> anyhow::Result<f64> {
    let (date, time) = ts.trim().split_once(' ').context("timestamp needs a date and a time")?;
    let d: Vec<i64> = date
        .split('-')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .context("bad date")?;
    let t: Vec<f64> = time
        .split(':')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .context("bad time")?;
    let ([y, m, day], [hh, mm, ss]) = (d.as_slice(), t.as_slice()) else {
        bail!("bad timestamp {ts:?}")
    };
    let in_range = (1..=9999).contains(y)
        && (1..=12).contains(m)
        && (1..=31).contains(day)
        && (0.0..24.0).contains(hh)
        && (0.0..60.0).contains(mm)
        && (0.0..61.0).contains(ss);
    if !in_range {
        bail!("timestamp {ts:?} is out of range");
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if *m <= 2 { y - 1 } else { *y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Ok(((days as f64 * 86_400.0) + hh * 3600.0 + mm * 60.0 + ss) * 1000.0)
}

/// Parameters of the generators (documented defaults).
#[derive(Clone, Debug)]
pub struct GenParams {
    pub rate: f64,
    pub seed: u64,
    pub groups: u64,
    pub prompts_per_group: u64,
    pub system_tokens: u64,
    pub question_tokens: u64,
    pub output_tokens: u64,
}

impl GenParams {
    pub fn defaults(g: Generator) -> GenParams {
        match g {
            // 64 groups × 16 prompts, 2048-token system prompt, 128-token question, 256 out.
            Generator::SharedPrefix => GenParams {
                rate: 8.0,
                seed: 0,
                groups: 64,
                prompts_per_group: 16,
                system_tokens: 2048,
                question_tokens: 128,
                output_tokens: 256,
            },
            // 64 conversations × 6 turns; 500-token system prompt; 150-token user turns; 200-token replies.
            Generator::MultiTurn => GenParams {
                rate: 4.0,
                seed: 0,
                groups: 64,
                prompts_per_group: 6,
                system_tokens: 500,
                question_tokens: 150,
                output_tokens: 200,
            },
            // 128 documents of 1500 tokens, 3 per query (Zipf), 200-token system prompt, 100-token question.
            Generator::Rag => GenParams {
                rate: 6.0,
                seed: 0,
                groups: 128,
                prompts_per_group: 3,
                system_tokens: 200,
                question_tokens: 100,
                output_tokens: 200,
            },
        }
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        kvroute_core::policy::mix(self.0)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Exponential inter-arrival gap in ms at `rate` per second.
    fn gap_ms(&mut self, rate: f64) -> f64 {
        -(1.0 - self.unit()).ln() / rate * 1000.0
    }
}

pub fn generate(g: Generator, p: &GenParams) -> Vec<SimRequest> {
    let mut rng = Rng(p.seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x5eed);
    let base = p.seed << 32;
    match g {
        Generator::SharedPrefix => {
            let mut order: Vec<(u64, u64)> = (0..p.groups)
                .flat_map(|gr| (0..p.prompts_per_group).map(move |q| (gr, q)))
                .collect();
            for i in (1..order.len()).rev() {
                order.swap(i, (rng.next() % (i as u64 + 1)) as usize);
            }
            let mut t = 0.0;
            order
                .into_iter()
                .map(|(gr, q)| {
                    t += rng.gap_ms(p.rate);
                    let segments = vec![
                        Segment::new(base ^ 0x5100_0000 ^ gr, p.system_tokens),
                        Segment::new(base ^ 0x5200_0000 ^ (gr << 16) ^ q, p.question_tokens),
                    ];
                    SimRequest {
                        arrival_ms: t,
                        segments,
                        output_tokens: p.output_tokens,
                    }
                })
                .collect()
        }
        Generator::MultiTurn => {
            // Conversations start as a Poisson process; turn k follows turn k−1 by a 10 s
            // think time plus an allowance for the reply.
            let mut out = Vec::new();
            let mut start = 0.0;
            for c in 0..p.groups {
                start += rng.gap_ms(p.rate / p.prompts_per_group as f64);
                let mut history = vec![Segment::new(base ^ 0x6100_0000 ^ c, p.system_tokens)];
                for turn in 0..p.prompts_per_group {
                    history.push(Segment::new(base ^ 0x6200_0000 ^ (c << 16) ^ turn, p.question_tokens));
                    let at = start + turn as f64 * (10_000.0 + p.output_tokens as f64 * 20.0);
                    out.push(SimRequest {
                        arrival_ms: at,
                        segments: history.clone(),
                        output_tokens: p.output_tokens,
                    });
                    history.push(Segment::new(base ^ 0x6300_0000 ^ (c << 16) ^ turn, p.output_tokens));
                }
            }
            out.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
            out
        }
        Generator::Rag => {
            let docs = p.groups.max(1);
            let weights: Vec<f64> = (1..=docs).map(|k| 1.0 / k as f64).collect();
            let total: f64 = weights.iter().sum();
            let count = docs * 8;
            let mut t = 0.0;
            (0..count)
                .map(|i| {
                    t += rng.gap_ms(p.rate);
                    let mut segments = vec![Segment::new(base ^ 0x7100_0000, p.system_tokens)];
                    for _ in 0..p.prompts_per_group {
                        let mut x = rng.unit() * total;
                        let doc = weights
                            .iter()
                            .position(|w| {
                                x -= w;
                                x <= 0.0
                            })
                            .unwrap_or(0) as u64;
                        segments.push(Segment::new(base ^ 0x7200_0000 ^ doc, 1500));
                    }
                    segments.push(Segment::new(base ^ 0x7300_0000 ^ i, p.question_tokens));
                    SimRequest {
                        arrival_ms: t,
                        segments,
                        output_tokens: p.output_tokens,
                    }
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests;
