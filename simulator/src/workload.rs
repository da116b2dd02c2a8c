//! Workloads: traces (Mooncake JSONL with prefix block ids, Azure CSV with lengths) and
//! generators (shared-prefix groups, multi-turn chat, RAG over shared documents), all
//! turned into requests whose prompt is deterministic text built from segments, so the
//! filter's text hashing and the engine's prefix cache see exactly the sharing the workload
//! encodes. Arrival times are in ms; `--rate-scale` divides them.

use std::fmt;

use crate::tokens::{render, Segment};

mod traces;
pub use traces::{describe_capture, parse_azure, parse_capture, parse_mooncake, CaptureNotes};

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
    /// Rag: the number of queries; `None` is 8 per document, so that a larger working set
    /// does not also mean a longer trace unless asked.
    pub queries: Option<u64>,
}

impl GenParams {
    /// The matrix's `long-chat`: multi-turn chat whose histories outgrow one server's KV
    /// cache, where a router that spreads a conversation's turns recomputes its history.
    /// 1,024 conversations × 8 turns, each with its own 1,000-token system prompt (an
    /// agent's instructions and tools), 200-token user turns and 200-token replies;
    /// conversations start at `rate` / 8 a second, turns 14 s apart (10 s of thinking, 4 s
    /// for the reply) before the matrix re-times the whole to a load.
    pub fn long_chat() -> GenParams {
        GenParams {
            rate: 100.0,
            groups: 1024,
            prompts_per_group: 8,
            system_tokens: 1000,
            question_tokens: 200,
            output_tokens: 200,
            ..GenParams::defaults(Generator::MultiTurn)
        }
    }

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
                queries: None,
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
                queries: None,
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
                queries: None,
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
            let count = p.queries.unwrap_or(docs * 8);
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
