//! The peers' baselines follow their sources' default algorithms (`cache_aware.rs`).

use super::cache_aware::sglang_spills;
use super::*;
use crate::profile::{Gpu, Model, Profile, BLOCK_TOKENS};

fn engines(n: usize) -> Vec<Engine> {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    (0..n).map(|_| Engine::new(profile.clone())).collect()
}

/// A request of `text` (its canonical bytes), `id`, over every server of a pool of `n`.
fn incoming<'a>(id: u64, text: &'a [u8], blocks: &'a [u64], pool: &'a [bool]) -> Incoming<'a> {
    Incoming {
        id,
        body: text,
        canonical: text,
        prompt_tokens: blocks.len() as u64 * BLOCK_TOKENS,
        engine_blocks: blocks,
        pool,
        ttft_objective_ms: None,
    }
}

fn finished(id: u64) -> Finished {
    Finished {
        id,
        arrival: 0.0,
        first_token: 0.0,
        finish: 0.0,
        prompt_tokens: 0,
        output_tokens: 0,
        cached_tokens: 0,
        itl_mean: 0.0,
        preemptions: 0,
    }
}

/// Three idle H100s behind `sglang-cache-aware`; every prompt spans the same engine blocks.
struct Sglang3 {
    servers: Vec<Engine>,
    pool: [bool; 3],
    p: SglangCacheAware,
    blocks: Vec<u64>,
}

impl Sglang3 {
    fn new() -> Sglang3 {
        Sglang3 {
            servers: engines(3),
            pool: [true; 3],
            p: SglangCacheAware::new(3),
            blocks: (0..40).collect(),
        }
    }

    fn pick(&mut self, id: u64, text: &[u8]) -> usize {
        self.p
            .pick(&incoming(id, text, &self.blocks, &self.pool), &self.servers, 0.0)
    }
}

#[test]
fn sglang_sends_a_prompt_matched_past_30_percent_to_its_tree_and_a_miss_to_the_least_loaded() {
    let mut f = Sglang3::new();
    let shared = vec![b'a'; 64 * 10];
    // Server 0 gets the first prompt (every load 0: the first), and keeps it outstanding.
    assert_eq!(f.pick(0, &shared), 0);
    // A prompt sharing 4 of its 10 blocks with it (40% > 30%) follows it there.
    let mut partial = shared[..64 * 4].to_vec();
    partial.extend(vec![b'b'; 64 * 6]);
    assert_eq!(f.pick(1, &partial), 0);
    // A prompt sharing 2 of 10 (20%) is a miss: the least loaded server, not the first.
    let mut slight = shared[..64 * 2].to_vec();
    slight.extend(vec![b'c'; 64 * 8]);
    assert_eq!(f.pick(2, &slight), 1);
    let other = vec![b'd'; 64 * 10];
    assert_eq!(f.pick(3, &other), 2);
}

#[test]
fn dynamo_charges_a_server_its_routed_prefill_until_the_first_token_and_breaks_ties_at_random() {
    let servers = engines(2);
    let pool = [true; 2];
    let mut p = DynamoKv::new(2, 7);
    let text = b"x";
    let a: Vec<u64> = (0..100).collect();
    let first = p.pick(&incoming(0, text, &a, &pool), &servers, 0.0);
    // Nothing cached anywhere: the other server, which has no prefill or blocks charged.
    let b: Vec<u64> = (1000..1100).collect();
    let second = p.pick(&incoming(1, text, &b, &pool), &servers, 0.0);
    assert_ne!(first, second, "the routed prefill counts where it was sent");
    // Once both have their first tokens and finish, the fleet is idle again: ties spread.
    for id in 0..2 {
        p.on_first_token(0, id, 1.0);
        p.on_finished(0, &finished(id), 2.0);
    }
    let picks: std::collections::BTreeSet<usize> = (10..40)
        .map(|id| {
            let blocks: Vec<u64> = (id * 1000..id * 1000 + 10).collect();
            let s = p.pick(&incoming(id, text, &blocks, &pool), &servers, 3.0);
            p.on_first_token(s, id, 3.0);
            p.on_finished(s, &finished(id), 3.0);
            s
        })
        .collect();
    assert_eq!(picks.len(), 2, "equal costs go to either server");
}

#[test]
fn dynamo_counts_a_prompts_blocks_already_active_on_a_server_once() {
    let servers = engines(2);
    let pool = [true; 2];
    let mut p = DynamoKv::new(2, 1);
    let a: Vec<u64> = (0..50).collect();
    let b: Vec<u64> = (100..150).collect();
    let s = p.pick(&incoming(0, b"x", &a, &pool), &servers, 0.0);
    p.on_first_token(s, 0, 1.0);
    // The other server, idle, takes a second prompt, which then decodes there too.
    let t = p.pick(&incoming(1, b"x", &b, &pool), &servers, 1.0);
    assert_ne!(s, t);
    p.on_first_token(t, 1, 2.0);
    // Both run 50 blocks; the first prompt again adds none where it runs, 50 elsewhere.
    assert_eq!(p.pick(&incoming(2, b"x", &a, &pool), &servers, 2.0), s);
    assert_eq!(p.pick(&incoming(3, b"x", &b, &pool), &servers, 2.0), t);
}

#[test]
fn gie_evicts_a_prompts_head_first_and_sglang_its_tail() {
    let blocks: Vec<u64> = (0..4).collect();
    let mut gie = ApproxIndex::new(1, 2, false);
    gie.insert(0, &blocks);
    assert_eq!(gie.matched(0, &blocks), 0, "prompt order: the head left first");
    let mut sglang = ApproxIndex::new(1, 2, true);
    sglang.insert(0, &blocks);
    assert_eq!(sglang.matched(0, &blocks), 2, "leaves first: the head stays");
}

#[test]
fn gie_reads_metrics_at_its_own_default_refresh() {
    assert_eq!(PolicyName::GieWeighted.scrape_interval_ms(200.0), 50.0);
    assert_eq!(PolicyName::Kvroute.scrape_interval_ms(200.0), 200.0);
}

#[test]
fn sglang_spills_a_matched_prompt_once_its_server_runs_well_above_the_pools_mean() {
    let servers = engines(4);
    let pool = [true; 4];
    let mut p = SglangCacheAware::new(4);
    let text = vec![b'a'; 64 * 10];
    let blocks: Vec<u64> = (0..40).collect();
    // Server 0 holds the prompt. With k requests outstanding there and none elsewhere the
    // mean is k/4, and k must pass it by max(4, 2·sqrt(k/4)) and by 1.5×: from k = 6.
    let picks: Vec<usize> = (0..7)
        .map(|id| p.pick(&incoming(id, &text, &blocks, &pool), &servers, 0.0))
        .collect();
    assert_eq!(picks, vec![0, 0, 0, 0, 0, 0, 1]);
    assert!(!sglang_spills(5, 1.25) && sglang_spills(6, 1.5));
}

#[test]
fn sglang_leaves_out_a_server_its_last_poll_read_overloaded_unless_every_one_is() {
    let mut f = Sglang3::new();
    let shared = vec![b'a'; 64 * 10];
    let poll = |waiting: u64, kv_usage: f64| VllmMetrics {
        waiting,
        kv_usage,
        ..VllmMetrics::default()
    };
    assert_eq!(f.pick(0, &shared), 0);
    // 8 waiting requests: the prompt its tree matches goes to the least loaded other server.
    f.p.on_scrape(0, &poll(8, 0.1), "", 10_000.0);
    assert_eq!(f.pick(1, &shared), 1);
    // Under both thresholds again (7 waiting, 79% KV): back to its tree.
    f.p.on_scrape(0, &poll(7, 0.79), "", 20_000.0);
    assert_eq!(f.pick(2, &shared), 0);
    // 80% KV is as much over as 8 waiting: the other tree that matches it (server 1's).
    f.p.on_scrape(0, &poll(0, 0.8), "", 30_000.0);
    assert_eq!(f.pick(3, &shared), 1);
    // Every server over: the least loaded of them, whatever the trees match (servers 0 and
    // 1 carry two requests each, server 2 none).
    f.p.on_scrape(1, &poll(9, 0.1), "", 30_000.0);
    f.p.on_scrape(2, &poll(9, 0.1), "", 30_000.0);
    assert_eq!(f.pick(4, &shared), 2);
    assert_eq!(PolicyName::SglangCacheAware.scrape_interval_ms(200.0), 10_000.0);
}
