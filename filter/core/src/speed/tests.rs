use super::*;

#[test]
fn later_tokens_of_a_prompt_cost_more_and_work_converts_back_to_tokens() {
    assert_eq!(prefill_work(0.0, 1000.0, 0.0), 1000.0);
    // 0 → 30k tokens at 30k: the mean position is half of it, so 1.5 × the tokens.
    assert!((prefill_work(0.0, 30_000.0, 30_000.0) - 45_000.0).abs() < 1e-6);
    // At 30k tokens of context a token costs about twice one at the start.
    assert!(prefill_work(30_000.0, 1000.0, 30_000.0) > 1.9 * prefill_work(0.0, 1000.0, 30_000.0));
    for (cached, tokens) in [(0.0, 5000.0), (12_000.0, 777.0), (40_000.0, 20_000.0)] {
        let work = prefill_work(cached, tokens, 30_000.0);
        assert!((tokens_for_work(cached, work, 30_000.0) - tokens).abs() < 1e-6);
    }
    assert_eq!(tokens_for_work(100.0, -5.0, 30_000.0), 0.0);
}

#[test]
fn a_pace_needs_three_first_tokens_of_real_prompts_and_is_forgotten() {
    let mut pace = PrefillPace::default();
    let t = Millis(1000);
    pace.observe(1000, 1000.0, 100, true, t);
    pace.observe(1000, 1000.0, 100, true, t);
    pace.observe(20, 20.0, 5000, true, t);
    assert_eq!(pace.per_ms(t), None, "a 20-token prompt is no sample");
    pace.observe(1000, 1000.0, 0, true, t);
    let per_ms = pace.per_ms(t).unwrap();
    assert_eq!(pace.per_ms(t.plus(FORGET_MS + 1)), None);
    // 0.81 × 1000 + 0.9 × 1000 + 1000 over 0.81 × 100 + 0.9 × 100 + 1 (a 0 ms sample
    // counts as 1 ms).
    assert!((per_ms - 2710.0 / 172.0).abs() < 1e-9, "{per_ms}");
}

#[test]
fn a_step_time_is_the_growth_of_the_inter_token_sums_and_follows_a_slowdown() {
    let mut step = StepTime::default();
    let t = Millis(1000);
    step.on_counters(Some(10.0), Some(1000.0), t);
    assert_eq!(step.ms(t), None, "the first scrape is the baseline");
    step.on_counters(Some(10.1), Some(1010.0), t.plus(200));
    assert_eq!(step.ms(t.plus(200)), None, "10 tokens are no sample; carried");
    // 0.5 s over 100 tokens since the baseline: 5 ms a step.
    step.on_counters(Some(10.5), Some(1100.0), t.plus(400));
    assert_eq!(step.ms(t.plus(400)), Some(5.0));
    // Slowed 3x: 15 ms a step; half of each new sample counts.
    step.on_counters(Some(12.0), Some(1200.0), t.plus(600));
    assert_eq!(step.ms(t.plus(600)), Some(10.0));
    step.on_counters(Some(13.5), Some(1300.0), t.plus(800));
    assert_eq!(step.ms(t.plus(800)), Some(12.5));
    // A restart (counters went down) starts a new baseline; a silent server is forgotten.
    step.on_counters(Some(0.1), Some(10.0), t.plus(1000));
    assert_eq!(step.ms(t.plus(1000)), Some(12.5));
    assert_eq!(step.ms(t.plus(800 + FORGET_MS + 1)), None);
    step.on_counters(None, Some(20.0), t.plus(1200));
    assert_eq!(
        step.ms(t.plus(1200)),
        Some(12.5),
        "a body without the sums changes nothing"
    );
}

const PRIOR: f64 = 20_000.0;

#[test]
fn the_prior_holds_until_enough_samples_then_the_rate_converges() {
    let mut s = Speed::default();
    s.observe(8000, 200, PRIOR, Millis(0)); // 40k tokens/s
    s.observe(8000, 200, PRIOR, Millis(10));
    assert_eq!(s.rate(PRIOR, Millis(10)), PRIOR);
    for i in 0..20 {
        s.observe(8000, 200, PRIOR, Millis(20 + i));
    }
    let r = s.rate(PRIOR, Millis(40));
    assert!((r - 40_000.0).abs() < 1.0, "{r}");
}

#[test]
fn a_server_that_slows_three_times_is_seen_within_a_few_samples() {
    let mut s = Speed::default();
    for i in 0..10 {
        s.observe(9000, 300, PRIOR, Millis(i)); // 30k
    }
    for i in 0..8 {
        s.observe(9000, 900, PRIOR, Millis(100 + i)); // 10k
    }
    let r = s.rate(PRIOR, Millis(200));
    assert!(r < 12_000.0, "{r}");
}

#[test]
fn scrapes_become_samples_once_enough_tokens_were_computed_and_a_restart_rebases() {
    let mut s = Speed::default();
    s.on_counters(Some(0.0), Some(0.0), PRIOR, Millis(0));
    for i in 1..=10u64 {
        // 1,000 tokens a scrape at 25k tokens/s: a sample every third scrape.
        s.on_counters(Some(1000.0 * i as f64), Some(0.04 * i as f64), PRIOR, Millis(i * 200));
    }
    assert_eq!(s.samples, 3);
    assert!((s.rate(PRIOR, Millis(2000)) - 25_000.0).abs() < 1.0);
    s.on_counters(Some(10.0), Some(0.001), PRIOR, Millis(2200));
    assert_eq!(
        s.baseline,
        Some(Baseline {
            tokens: 10.0,
            seconds: 0.001,
            at: Millis(2200)
        }),
        "a restarted server starts over"
    );
    s.on_counters(None, None, PRIOR, Millis(2400));
    assert_eq!(s.samples, 3, "a server without the counters teaches nothing");
}

#[test]
fn prefills_sharing_steps_are_measured_in_wall_time_over_a_window() {
    // 30k tokens/s drained, four prefills at a time: each request's own seconds sum to
    // four times the wall time. The plain ratio would say 7.5k.
    let mut s = Speed::default();
    let mut t = 0u64;
    s.on_counters(Some(0.0), Some(0.0), PRIOR, Millis(t));
    let (mut tokens, mut seconds) = (0.0, 0.0);
    for _ in 0..40 {
        t += 200;
        tokens += 6000.0;
        seconds += 0.8;
        s.on_counters(Some(tokens), Some(seconds), PRIOR, Millis(t));
    }
    assert_eq!(s.samples, 4, "one sample per {MIN_WINDOW_MS} ms window, not per scrape");
    let r = s.rate(PRIOR, Millis(t));
    assert!((r - 30_000.0).abs() < 1.0, "{r}");
}

#[test]
fn one_long_prefill_finishing_after_a_scrape_is_not_a_burst() {
    // One 24k-token prompt prefilled at 24k tokens/s in 1 s, seen 200 ms after the
    // previous sample: its second is counted against the window, not 200 ms.
    let mut s = Speed::default();
    s.on_counters(Some(0.0), Some(0.0), PRIOR, Millis(0));
    s.on_counters(Some(24_000.0), Some(1.0), PRIOR, Millis(200));
    assert_eq!(s.samples, 0, "wait: the seconds outgrew the 200 ms since the baseline");
    for t in [400, 600, 800, 1000] {
        s.on_counters(Some(24_000.0), Some(1.0), PRIOR, Millis(t));
    }
    assert_eq!(s.samples, 1, "taken once the wall time covers the seconds");
    assert_eq!(s.log_rate.map(f64::exp).map(f64::round), Some(24_000.0));
}

#[test]
fn short_prompts_absurd_samples_and_old_knowledge_do_not_mislead() {
    let mut s = Speed::default();
    for i in 0..10 {
        s.observe(500, 1, PRIOR, Millis(i));
    }
    assert_eq!(s.learned(Millis(10)), None, "too few tokens ahead to say anything");
    for i in 0..10 {
        s.observe(4000, 1, PRIOR, Millis(i));
    }
    assert!((s.rate(PRIOR, Millis(10)) - PRIOR * CLAMP).abs() < 1e-6, "clamped");
    assert_eq!(s.rate(PRIOR, Millis(10 + FORGET_MS + 1)), PRIOR, "forgotten");
}

#[test]
fn the_ttft_bias_learns_the_ratio_ignores_tiny_predictions_and_forgets() {
    let mut b = TtftBias::default();
    let t = Millis(1000);
    assert_eq!(b.factor(t), 1.0);
    for _ in 0..40 {
        b.observe(100.0, 300.0, t);
        b.observe(5.0, 500.0, t);
    }
    assert!((b.factor(t) - 3.0).abs() < 0.01, "a steady ratio: {}", b.factor(t));
    assert_eq!(b.factor(t.plus(FORGET_MS + 1)), 1.0);
    let mut spread = TtftBias::default();
    for _ in 0..40 {
        spread.observe(100.0, 150.0, t);
        spread.observe(100.0, 600.0, t);
    }
    assert!(
        spread.factor(t) > 4.0,
        "a spread ratio is trusted near its top: {}",
        spread.factor(t)
    );
}

#[test]
fn a_first_scrape_with_history_establishes_the_rate_at_once() {
    // A server that ran before this gateway started: 120k tokens in 10 s of prefill.
    let mut s = Speed::default();
    s.on_counters(Some(120_000.0), Some(10.0), PRIOR, Millis(0));
    let r = s.learned(Millis(0)).unwrap();
    assert!((r - 12_000.0).abs() < 1e-6, "{r}");
    // Live samples then move it at the usual pace.
    s.on_counters(Some(150_000.0), Some(11.0), PRIOR, Millis(3000)); // 30k tokens/s
    let r = s.learned(Millis(3000)).unwrap();
    assert!(
        r > 14_000.0 && r < 16_000.0,
        "one sample moves it a quarter of the way: {r}"
    );
}

#[test]
fn a_short_history_or_a_restarted_server_teaches_nothing_at_once() {
    let mut s = Speed::default();
    s.on_counters(Some((HISTORY_TOKENS - 1) as f64), Some(0.1), PRIOR, Millis(0));
    assert_eq!(s.learned(Millis(0)), None, "less history than three samples");
    let mut s = Speed::default();
    s.on_counters(Some(1e6), Some(0.0), PRIOR, Millis(0));
    assert_eq!(s.learned(Millis(0)), None, "tokens without seconds");
    // Counters that went down are a restarted server: a new baseline, no seed.
    let mut s = Speed::default();
    s.on_counters(Some(1000.0), Some(0.05), PRIOR, Millis(0));
    s.on_counters(Some(500_000.0), Some(20.0), PRIOR, Millis(200));
    let learned = s.learned(Millis(200));
    s.on_counters(Some(100_000.0), Some(2.0), PRIOR, Millis(400));
    assert_eq!(s.learned(Millis(400)), learned, "the rebase seeds nothing");
}
