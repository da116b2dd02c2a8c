//! The traces a replay reads: Mooncake JSONL (prefix block ids), Azure CSV (lengths, with
//! an optional prefix overlay) and kvroute's own traffic capture.

use anyhow::{bail, Context};
use serde::Deserialize;

use super::{SimRequest, MOONCAKE_BLOCK_TOKENS};
use crate::tokens::Segment;

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
