//! route() including prefix hashing, on 8 / 64 / 256 endpoints × 1k / 8k / 32k-token prompts.
//!
//! Each router has fresh metrics on every endpoint and an index warmed by 512 earlier
//! requests of 64 prefix groups, and the measured prompt's group is already held by one
//! endpoint, so the index walk is a real partial hit. Also: JSON parsing of the same bodies,
//! and the prefix index's bookkeeping of a routed prompt (`index_record`).

#![allow(clippy::expect_used)] // a bench whose setup fails should stop loudly

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute_core::request::{parse, ApiKind};
use kvroute_core::{BlockHash, Config, EndpointId, Millis, RawConfig, Router, Tokens, VllmMetrics};
use std::hint::black_box;

const NOW: Millis = Millis(1_000);

fn body(group: usize, tokens: usize, question: usize) -> String {
    // 4 bytes per token; the shared part is the group's system prompt, then a question.
    let system: String = format!("group {group:04} system prompt text. ").repeat(tokens * 4 / 31 + 1);
    let system = &system[..tokens * 4 - 64];
    format!(
        r#"{{"model":"m","max_tokens":128,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"question number {question:040}"}}]}}"#
    )
}

fn router(endpoints: usize) -> Router {
    router_with(endpoints, RawConfig::default())
}

fn router_with(endpoints: usize, raw: RawConfig) -> Router {
    let raw = RawConfig {
        endpoints: (0..endpoints)
            .map(|i| format!("10.2.{}.{}:8000", i / 250, i % 250))
            .collect(),
        ..raw
    };
    let mut r = Router::new(Config::try_from(raw).expect("valid config"));
    let ids: Vec<EndpointId> = r.endpoints().iter().map(|e| e.id.clone()).collect();
    for (i, id) in ids.iter().enumerate() {
        let m = VllmMetrics {
            kv_usage: (i % 10) as f64 / 12.0,
            running: (i % 7) as u64 * 4,
            waiting: (i % 5) as u64,
            block_size: Some(16),
            num_gpu_blocks: Some(29_205),
            models: vec!["m".into()],
            engines: 1,
            ..VllmMetrics::default()
        };
        r.on_metrics(id, m, NOW);
    }
    for n in 0..512 {
        let parsed = parse(ApiKind::Chat, body(n % 64, 2048, n).as_bytes()).expect("valid body");
        let req = r.request(&parsed, "", false);
        let d = r.route(&req, NOW);
        r.on_routed(n as u64, &req, &d, NOW);
    }
    r
}

fn bench_route(c: &mut Criterion) {
    let mut group = c.benchmark_group("route_with_hashing");
    for endpoints in [8, 64, 256] {
        let mut r = router(endpoints);
        for tokens in [1024, 8192, 32768] {
            // Seed the measured group's prefix on one endpoint.
            let seed = parse(ApiKind::Chat, body(7, tokens, 1).as_bytes()).expect("valid body");
            let seed_req = r.request(&seed, "", false);
            let d = r.route(&seed_req, NOW);
            r.on_routed(10_000 + tokens as u64, &seed_req, &d, NOW);
            let parsed = parse(ApiKind::Chat, body(7, tokens, 2).as_bytes()).expect("valid body");
            group.throughput(Throughput::Elements(1));
            group.bench_with_input(
                BenchmarkId::new(format!("{endpoints}ep"), format!("{tokens}tok")),
                &parsed,
                |b, p| {
                    b.iter(|| {
                        let req = r.request(black_box(p), "", false);
                        black_box(r.route(&req, NOW))
                    })
                },
            );
        }
    }
    group.finish();
}

/// route() with price tiers on (half the servers premium), 64 endpoints, a 1k-token prompt,
/// while every server has 0 / 64 / 512 requests without a first token, none of them a
/// stream of this router's: the tiers' oldest-wait floor looks for the oldest that is.
fn bench_route_tiers(c: &mut Criterion) {
    let mut group = c.benchmark_group("route_tiers_pending");
    for pending in [0usize, 64, 512] {
        let mut raw = RawConfig::default();
        raw.tiers.endpoints = (32..64).map(|i| (format!("10.2.0.{i}:8000"), 1)).collect();
        let mut r = router_with(64, raw);
        for n in 0..pending * 64 {
            let parsed = parse(ApiKind::Chat, body(n % 64, 256, n).as_bytes()).expect("valid body");
            let req = r.request(&parsed, "", false);
            let d = r.route(&req, NOW);
            r.on_routed(100_000 + n as u64, &req, &d, NOW);
        }
        let parsed = parse(ApiKind::Chat, body(7, 1024, 2).as_bytes()).expect("valid body");
        group.bench_with_input(BenchmarkId::from_parameter(pending), &parsed, |b, p| {
            b.iter(|| {
                let req = r.request(black_box(p), "", false);
                black_box(r.route(&req, NOW))
            })
        });
    }
    group.finish();
}

fn bench_parse(c: &mut Criterion) {
    let mut group = c.benchmark_group("parse_body");
    for tokens in [1024, 8192, 32768] {
        let b = body(1, tokens, 1);
        group.throughput(Throughput::Bytes(b.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(format!("{tokens}tok")), &b, |bench, b| {
            bench.iter(|| {
                black_box(
                    parse(ApiKind::Chat, black_box(b.as_bytes()))
                        .map(|p| p.prompt_tokens)
                        .unwrap_or(Tokens(0)),
                )
            })
        });
    }
    group.finish();
}

/// The worst bodies we could construct within the filter's 4 MiB cap: many tiny messages,
/// one string made of escapes, tools nested to serde_json's depth limit.
fn bench_hostile(c: &mut Criterion) {
    const CAP: usize = 4 << 20;
    let one = r#"{"role":"user","content":"hi"},"#;
    let many = format!(
        r#"{{"model":"m","messages":[{}{{"role":"user","content":"end"}}]}}"#,
        one.repeat(CAP / one.len() - 2)
    );
    let escapes = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "\\u00e9".repeat(CAP / 6 - 20)
    );
    let ids = format!(r#"{{"model":"m","prompt":[{}1]}}"#, "1,".repeat(CAP / 2 - 20));
    let nested = format!(
        r#"{{"model":"m","tools":{}{},"messages":[{{"role":"user","content":"x"}}]}}"#,
        "[".repeat(126),
        "]".repeat(126)
    );
    let mut group = c.benchmark_group("parse_hostile_4mib");
    group.sample_size(10);
    // Each body with the API it belongs to: a completions body parsed as chat would only
    // measure the error path. (`many_messages` is over the message cap and is refused: its
    // figure is what refusing costs.)
    for (name, kind, body) in [
        ("many_messages", ApiKind::Chat, &many),
        ("escaped_string", ApiKind::Chat, &escapes),
        ("nested_tools", ApiKind::Chat, &nested),
        ("token_ids", ApiKind::Completions, &ids),
    ] {
        group.bench_with_input(
            BenchmarkId::from_parameter(format!("{name}_{}KiB", body.len() / 1024)),
            body,
            |b, body| {
                b.iter(|| {
                    black_box(
                        parse(kind, black_box(body.as_bytes()))
                            .map(|p| p.prompt_tokens)
                            .unwrap_or(Tokens(0)),
                    )
                })
            },
        );
    }
    group.finish();
}

/// Traffic capture's share of a request: the sampling check, the ids (one SipHash-2-4 per
/// 256-byte block) and the JSON line, for a 1 KiB and an 8k-token prompt.
fn bench_capture(c: &mut Criterion) {
    use kvroute_core::capture::{CaptureLine, Capturer};
    let mut raw = RawConfig::default();
    raw.capture.sample = 1.0;
    raw.capture.salt = "bench-capture-salt-0123".into();
    let config = Config::try_from(raw).expect("valid config");
    let capturer = Capturer::new(config.capture(), config.hashing().block_bytes).expect("capture on");
    let r = router(8);
    let mut group = c.benchmark_group("capture_line");
    for (label, text) in [("1KiB", body(1, 256, 7)), ("8k_tokens", body(1, 8192, 7))] {
        let parsed = parse(ApiKind::Chat, text.as_bytes()).expect("valid body");
        let req = r.request(&parsed, "", false);
        group.bench_function(label, |b| {
            b.iter(|| {
                assert!(capturer.sampled(black_box(&req.blocks), 1));
                let ids = capturer.ids(black_box(&req.blocks));
                CaptureLine {
                    timestamp: 1_795_000_000_000,
                    model: &req.model,
                    input_length: req.prompt_tokens.0,
                    output_length: 128,
                    usage: true,
                    hash_ids: &ids,
                    block_tokens: capturer.block_tokens(),
                    server: Some("10.2.0.1:8000"),
                    cached_tokens: Some(512),
                    status: 200,
                }
                .to_json()
            })
        });
    }
    group.finish();
}

/// The filter's hold board (`overload.hold`): what a holding worker does to it at each tick
/// (decode, then encode after a change), at 64 and 1,024 held requests (the default bound)
/// over 4 tenants × 3 priority bands; an item is 16 bytes, as the filter's ticket.
fn bench_hold_board(c: &mut Criterion) {
    use kvroute_core::hold::{take, HoldQueue};
    let mut group = c.benchmark_group("hold_board");
    for held in [64usize, 1024] {
        let mut q = HoldQueue::new(1024, 4.0);
        for i in 0..held as u64 {
            q.push((i % 8, i), (i % 3) as i64 - 1, &format!("{:016x}", i % 4), Millis(i));
        }
        let mut bytes = Vec::new();
        q.encode(&mut bytes, |t, out| {
            out.extend(t.0.to_le_bytes());
            out.extend(t.1.to_le_bytes());
        });
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.bench_function(BenchmarkId::new("decode_encode", held), |b| {
            b.iter(|| {
                let mut rest = black_box(bytes.as_slice());
                let q = HoldQueue::decode(&mut rest, 1024, 4.0, |b| {
                    Some((u64::from_le_bytes(take(b)?), u64::from_le_bytes(take(b)?)))
                })
                .expect("a board");
                let mut out = Vec::with_capacity(bytes.len());
                q.encode(&mut out, |t, out| {
                    out.extend(t.0.to_le_bytes());
                    out.extend(t.1.to_le_bytes());
                });
                out
            })
        });
    }
    group.finish();
}

/// `PrefixIndex::record`, the index's part of a routed request's bookkeeping: a server with
/// the KV size of the router benches (29,205 blocks), filled to capacity by earlier
/// conversations, then a 512-block prompt (8k tokens) whose first 448 blocks it holds and
/// whose last 64 are new each time (a conversation's next turn: touches, inserts, as many
/// evictions), and the same prompt sent again whole (touches only).
fn bench_index_record(c: &mut Criterion) {
    use kvroute_core::index::PrefixIndex;
    let mut group = c.benchmark_group("index_record");
    let mut index = PrefixIndex::new(64 << 20);
    index.set_capacity(0, 29_205);
    let mut next = 1u64;
    let mut fresh = |n: usize| -> Vec<BlockHash> {
        (0..n)
            .map(|_| {
                next += 1;
                BlockHash(next.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            })
            .collect()
    };
    for _ in 0..64 {
        index.record(0, &fresh(512));
    }
    let held = fresh(448);
    index.record(0, &held);
    group.bench_function("next_turn_512", |b| {
        b.iter_batched(
            || [held.clone(), fresh(64)].concat(),
            |prompt| index.record(0, black_box(&prompt)),
            criterion::BatchSize::SmallInput,
        )
    });
    let whole = [held.clone(), fresh(64)].concat();
    index.record(0, &whole);
    group.bench_function("held_512", |b| b.iter(|| index.record(0, black_box(&whole))));
    group.finish();
}

criterion_group!(
    benches,
    bench_route,
    bench_route_tiers,
    bench_parse,
    bench_hostile,
    bench_capture,
    bench_hold_board,
    bench_index_record
);
criterion_main!(benches);
