use super::*;
use crate::profile::{Gpu, Model};

fn engine(blocks: u64) -> Engine {
    Engine::new(
        Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1)
            .unwrap()
            .with_blocks(blocks),
    )
}

fn spec(id: u64, prompt: u64, output: u64, prefix: u64) -> SeqSpec {
    // Blocks of the same `prefix` family share hashes: 1000·prefix + index.
    SeqSpec {
        id,
        prompt_tokens: prompt,
        output_tokens: output,
        block_hashes: (0..prompt / 16).map(|i| prefix * 1000 + i).collect(),
        stops: false,
    }
}

/// Runs until idle; returns the finished requests in completion order.
fn run(e: &mut Engine, mut now: f64) -> Vec<Finished> {
    let mut done = Vec::new();
    while let Some(d) = e.start_step() {
        now += d;
        for ev in e.finish_step(now) {
            if let Event::Finished(f) = ev {
                done.push(f);
            }
        }
    }
    done
}

#[test]
fn a_repeated_prompt_hits_the_prefix_cache() {
    let mut e = engine(10_000);
    e.add(spec(1, 1024, 4, 7), 0.0);
    let first = run(&mut e, 0.0);
    e.add(spec(2, 1024, 4, 7), 1000.0);
    let second = run(&mut e, 1000.0);
    assert_eq!(first[0].cached_tokens, 0);
    assert_eq!(
        second[0].cached_tokens, 1008,
        "all but the last block: one token must be computed"
    );
    let ttft = |f: &Finished| f.first_token - f.arrival;
    assert!(ttft(&second[0]) < ttft(&first[0]) / 2.0);
    assert_eq!((e.counters.prefix_queries, e.counters.prefix_hits), (2048, 1008));
}

#[test]
fn long_prompts_are_prefilled_in_chunks_of_the_token_budget() {
    let mut e = engine(10_000);
    e.add(spec(1, 20_000, 2, 1), 0.0);
    let mut steps_to_first_token = 0;
    let mut now = 0.0;
    loop {
        now += e.start_step().unwrap();
        steps_to_first_token += 1;
        if e.finish_step(now)
            .iter()
            .any(|ev| matches!(ev, Event::FirstToken { .. }))
        {
            break;
        }
    }
    assert_eq!(steps_to_first_token, 3, "20k tokens over 8192-token steps");
}

#[test]
fn decode_batches_share_steps() {
    let mut e = engine(10_000);
    for id in 0..8 {
        e.add(spec(id, 64, 50, 100 + id), 0.0);
    }
    let done = run(&mut e, 0.0);
    assert_eq!(done.len(), 8);
    let last = done.iter().map(|f| f.finish).fold(0.0, f64::max);
    assert!(
        last < 60.0 * 10.0,
        "8 requests of 50 tokens decode together ({last} ms)"
    );
    assert!(done.iter().all(|f| f.itl_mean > 5.0 && f.itl_mean < 12.0));
}

#[test]
fn running_out_of_blocks_preempts_by_recompute_and_everything_finishes() {
    let mut e = engine(40); // 39 usable blocks = 624 tokens
    for id in 0..4 {
        e.add(spec(id, 128, 100, 200 + id), 0.0);
    }
    let done = run(&mut e, 0.0);
    assert_eq!(done.len(), 4);
    assert!(e.counters.preemptions > 0, "4 × 228 tokens cannot all fit in 624");
    // vllm:request_num_preemptions: every finished request, its preemptions summed.
    let h = &e.counters.requests.num_preemptions;
    assert_eq!(h.count, 4);
    assert_eq!(h.sum, e.counters.preemptions as f64);
    assert!(done.iter().all(|f| f.output_tokens == 100));
    assert_eq!(e.kv().usage(), 0.0, "every block was released");
}

#[test]
fn usage_counts_referenced_blocks_over_usable_blocks() {
    let mut e = engine(101);
    e.add(spec(1, 160, 100, 1), 0.0);
    let d = e.start_step().unwrap();
    e.finish_step(d);
    // The prefill computed 160 tokens (10 blocks); the first output token gets its KV slot
    // in the next step, as in vLLM.
    assert!((e.kv().usage() - 0.10).abs() < 1e-9, "{}", e.kv().usage());
}

#[test]
fn the_same_inputs_give_the_same_timeline() {
    let timeline = || {
        let mut e = engine(500);
        for id in 0..20 {
            e.add(spec(id, 100 + id * 37, 20 + id, id % 3), id as f64 * 3.0);
        }
        run(&mut e, 0.0)
    };
    assert_eq!(timeline(), timeline());
}

#[test]
fn queued_work_excludes_the_prefix_a_waiting_request_will_find_cached() {
    let mut e = engine(10_000);
    e.add(spec(1, 1024, 4, 7), 0.0);
    run(&mut e, 0.0);
    // A long prompt fills the step's token budget, so the next two wait behind it: one
    // repeats the cached 1024-token prompt (all but its last block is cached), one is new.
    e.add(spec(2, 20_000, 2, 1), 1000.0);
    let now = 1000.0 + e.start_step().unwrap();
    e.finish_step(now);
    e.add(spec(3, 1024, 4, 7), now);
    e.add(spec(4, 1024, 4, 9), now);
    assert_eq!(e.num_waiting(), 2);
    assert_eq!(e.pending_prefill_tokens(), (20_000 - 8192) + 16 + 1024);
}

#[test]
fn with_cache_at_schedule_a_sibling_admitted_in_the_same_step_hits_its_chunk() {
    let siblings = |at_schedule: bool| {
        let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1)
            .unwrap()
            .with_cache_at_schedule(at_schedule);
        let mut e = Engine::new(profile);
        // Two prompts of one family arrive together: both are admitted in the first step
        // (1,024 + 1,024 tokens within the 8,192 budget).
        e.add(spec(1, 1024, 4, 7), 0.0);
        e.add(spec(2, 1024, 4, 7), 0.0);
        let done = run(&mut e, 0.0);
        done.iter().find(|f| f.id == 2).map(|f| f.cached_tokens).unwrap()
    };
    assert_eq!(siblings(false), 0, "blocks hittable only once their step ended");
    assert_eq!(siblings(true), 1008, "vLLM V1: cached when scheduled");
}
