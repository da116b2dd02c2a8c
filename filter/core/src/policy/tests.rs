use super::*;
use crate::endpoint::EndpointTable;

fn table_of(n: usize) -> EndpointTable {
    let mut table = EndpointTable::default();
    let ids: Vec<EndpointId> = (1..=n).map(|i| EndpointId::new(format!("10.0.0.{i}:8000"))).collect();
    table.replace(&ids);
    table
}

/// Every endpoint of `table` as an idle candidate for a prompt of `uncached` tokens.
fn idle_cands<'a>(table: &'a EndpointTable, idle: &'a VllmMetrics, uncached: u64) -> Vec<Candidate<'a>> {
    table
        .rows()
        .iter()
        .map(|endpoint| Candidate {
            endpoint,
            metrics: idle,
            matched_blocks: 0,
            uncached: Tokens(uncached),
        })
        .collect()
}

/// A context at time 0 with no backlog and the given rate classes and typical pace.
fn ctx_at_zero(rates: RateClasses, typical_pace: Option<f64>) -> ScoreContext {
    ScoreContext {
        total_blocks: 0,
        fleet_backlog: 0.0,
        unlike: false,
        mean_uncached_tokens: 0.0,
        rotation: 0,
        seed: 0,
        now: Millis(0),
        rates,
        typical_pace,
        rate_per_pace: None,
        typical_step: None,
        fastest_step: None,
        typical_weight: None,
    }
}

fn cands<'a>(table: &'a EndpointTable, metrics: [&'a VllmMetrics; 2]) -> Vec<Candidate<'a>> {
    cands_of(table, metrics, 1000)
}

/// `table`'s first `N` endpoints with these metrics, each for `uncached` tokens.
fn cands_of<'a, const N: usize>(
    table: &'a EndpointTable,
    metrics: [&'a VllmMetrics; N],
    uncached: u64,
) -> Vec<Candidate<'a>> {
    table
        .rows()
        .iter()
        .zip(metrics)
        .map(|(endpoint, metrics)| Candidate {
            endpoint,
            metrics,
            matched_blocks: 0,
            uncached: Tokens(uncached),
        })
        .collect()
}

#[test]
fn the_backlog_counts_prefills_queued_in_the_running_batch() {
    let mut table = EndpointTable::default();
    table.replace(&[EndpointId::new("10.0.0.1:8000"), EndpointId::new("10.0.0.2:8000")]);
    let config = Config::from_json(b"{}").unwrap();
    // Nothing waits anywhere, but 40k and 100k tokens of this gateway's prompts have no
    // first token yet: 4 and 10 requests of 10k, one of them prefilling.
    table.rows_mut()[0].pending_prefill_tokens = Tokens(40_000);
    table.rows_mut()[1].pending_prefill_tokens = Tokens(100_000);
    let idle = VllmMetrics::default();
    let busy = VllmMetrics {
        waiting: 5,
        ..VllmMetrics::default()
    };
    assert_eq!(
        fleet_backlog(&config, &cands(&table, [&idle, &idle]), 10_000.0, Millis(0)),
        3.0,
        "the least-loaded server's queue"
    );
    assert_eq!(
        fleet_backlog(&config, &cands(&table, [&busy, &idle]), 10_000.0, Millis(0)),
        5.0,
        "waiting counts when it is more"
    );
    assert_eq!(
        fleet_backlog(&config, &cands(&table, [&idle, &idle]), 80_000.0, Millis(0)),
        0.0,
        "one request prefilling is no queue"
    );
}

#[test]
fn a_server_with_no_learned_rate_is_placed_by_its_pace_when_it_is_far_off() {
    let config = Config::from_json(b"{}").unwrap();
    let mut table = table_of(3);
    // First tokens came 4× slower from the third server, 1.5× from the second.
    for (row, ms) in [(0, 100), (1, 150), (2, 400)] {
        for _ in 0..PrefillPace::PLACE_SAMPLES {
            table.rows_mut()[row].pace.observe(3000, 3000.0, ms, true, Millis(0));
        }
    }
    let idle = VllmMetrics::default();
    let cands = idle_cands(&table, &idle, 1000);
    let ctx = |typical_pace| ctx_at_zero(RateClasses::default(), typical_pace);
    let ms =
        |ctx: &ScoreContext| -> Vec<f64> { cands.iter().map(|c| predicted_ttft(&config, c, ctx).ttft_ms).collect() };
    let paced = ctx(typical_pace(&config, &cands, Millis(0)));
    let [fast, near, slow] = ms(&paced)[..] else { panic!() };
    assert_eq!(fast, near, "within 2x of the median pace: typical");
    assert!(
        (slow / near - 400.0 / 150.0).abs() < 1e-9,
        "past 2x: its own pace ({slow} vs {near})"
    );
    // The configured rate stands in for the typical one: 1000 tokens at 20k/s.
    assert!((near - 50.0).abs() < 1e-9, "{near}");
    let unpaced = ctx(None);
    assert!(ms(&unpaced).iter().all(|m| (m - 50.0).abs() < 1e-9));
}

#[test]
fn a_slower_gpu_is_placed_from_its_first_prompts_and_an_unlucky_like_server_is_not() {
    let config = Config::from_json(b"{}").unwrap();
    let mut table = table_of(4);
    for row in 0..2 {
        for _ in 0..PrefillPace::PLACE_SAMPLES {
            table.rows_mut()[row].pace.observe(3000, 3000.0, 100, true, Millis(0));
        }
    }
    // Three prompts each: the third server waited behind others twice but was as fast
    // once; the fourth was 3× slower every time.
    for (row, times) in [(2, [300, 300, 100]), (3, [300, 300, 300])] {
        for ms in times {
            table.rows_mut()[row].pace.observe(3000, 3000.0, ms, true, Millis(0));
        }
    }
    let idle = VllmMetrics::default();
    let cands = idle_cands(&table, &idle, 1000);
    let ctx = ctx_at_zero(RateClasses::default(), typical_pace(&config, &cands, Millis(0)));
    let [fast, _, unlucky, slow] = cands
        .iter()
        .map(|c| predicted_ttft(&config, c, &ctx).ttft_ms)
        .collect::<Vec<_>>()[..]
    else {
        panic!()
    };
    let unlucky_pace = table.rows()[2].pace.per_ms(Millis(0)).unwrap();
    assert!(
        unlucky_pace * PACE_SAME_WITHIN < 30.0,
        "its pace alone reads over 2x slow ({unlucky_pace})"
    );
    assert_eq!(unlucky, fast, "one fast sample of three: typical");
    assert!((slow / fast - 3.0).abs() < 1e-9, "{slow} vs {fast}");
}

#[test]
fn an_unlike_server_is_charged_its_longer_steps_and_like_servers_are_not() {
    let config = Config::from_json(b"{}").unwrap();
    let mut table = table_of(4);
    // Three H100s (40k tokens/s), one with a busy batch's 9 ms steps, and an A100
    // (12k tokens/s) with 9 ms steps.
    for (row, rate, step) in [
        (0, 40_000.0, 5.0),
        (1, 40_000.0, 5.0),
        (2, 40_000.0, 9.0),
        (3, 12_000.0, 9.0),
    ] {
        table.rows_mut()[row].speed = crate::speed::Speed::exact(rate, Millis(0));
        table.rows_mut()[row].step = crate::speed::StepTime::exact(step, Millis(0));
    }
    let idle = VllmMetrics::default();
    let cands = idle_cands(&table, &idle, 1200);
    let ctx = ctx_at_zero(rate_classes(&config, &cands, Millis(0)), None);
    let ctx = with_steps(&config, &cands, ctx);
    let ms: Vec<f64> = cands.iter().map(|c| predicted_ttft(&config, c, &ctx).ttft_ms).collect();
    assert!(
        (ms[0] - 30.0).abs() < 1e-9,
        "1200 tokens at 40k/s, no step charge: {}",
        ms[0]
    );
    assert_eq!(ms[0], ms[2], "a like server's longer steps are not charged");
    // 100 ms of prefill at 12k/s, then 1.5 steps of 9 ms against the H100s' 5 ms.
    assert!((ms[3] - (100.0 + 1.5 * 4.0)).abs() < 1e-9, "{}", ms[3]);
    let off = Config::from_json(br#"{"cost": {"first_token_steps": 0}}"#).unwrap();
    assert!((predicted_ttft(&off, &cands[3], &ctx).ttft_ms - 100.0).abs() < 1e-9);
}

/// Predicted TTFT (no step charge) of 1,200 uncached tokens on each of `table`'s idle
/// servers, with `config`'s speed weights.
fn weighted_ms(config_json: &str, table: &EndpointTable) -> Vec<f64> {
    let config = Config::from_json(config_json.as_bytes()).unwrap();
    let idle = VllmMetrics::default();
    let cands = idle_cands(table, &idle, 1200);
    let mut ctx = ctx_at_zero(rate_classes(&config, &cands, Millis(0)), None);
    ctx.typical_weight = typical_weight(&config, &cands, &ctx.rates, Millis(0));
    cands.iter().map(|c| predicted_ttft(&config, c, &ctx).ttft_ms).collect()
}

const H100_H100_A100_A100: &str = r#"{"cost": {"first_token_steps": 0, "speed_weights":
    {"10.0.0.1:8000": 3, "10.0.0.2:8000": 3, "10.0.0.3:8000": 1, "10.0.0.4:8000": 1}}}"#;

#[test]
fn a_server_weighted_slower_is_scored_slower_until_its_own_rate_is_learned() {
    let mut table = table_of(4);
    let ms = weighted_ms(H100_H100_A100_A100, &table);
    // Nothing learned: the configured 20k tokens/s is the typical (weight 3) servers'.
    let near = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9);
    assert!(near(&ms, &[60.0, 60.0, 180.0, 180.0]), "{ms:?}");
    table.rows_mut()[3].speed = crate::speed::Speed::exact(12_000.0, Millis(0));
    let ms = weighted_ms(H100_H100_A100_A100, &table);
    assert!((ms[3] - 100.0).abs() < 1e-9, "its learned 12k/s: {ms:?}");
    // The typical rate is now the only one learned (12k, at weight 1): the weight-3
    // servers are scored at 36k/s, the other weight-1 server at 12k/s.
    assert!(
        (ms[0] - 1200.0 / 36.0).abs() < 1e-9 && (ms[2] - 100.0).abs() < 1e-9,
        "{ms:?}"
    );
}

#[test]
fn envoy_weights_count_when_asked_where_the_config_names_no_weight() {
    let mut table = table_of(4);
    for (row, w) in [3, 3, 1, 1].into_iter().enumerate() {
        table.rows_mut()[row].lb_weight = w;
    }
    let from_envoy = r#"{"cost": {"first_token_steps": 0, "speed_weights_from_envoy": true}}"#;
    assert_eq!(
        weighted_ms(from_envoy, &table),
        weighted_ms(H100_H100_A100_A100, &table_of(4))
    );
    assert_eq!(
        weighted_ms(r#"{"cost": {"first_token_steps": 0}}"#, &table),
        [60.0; 4],
        "not read unless asked: weights set for a canary's share are no speed"
    );
    // The config's weight wins: server 1 named at 1 beside its Envoy weight of 3.
    let named = r#"{"cost": {"first_token_steps": 0, "speed_weights_from_envoy": true,
        "speed_weights": {"10.0.0.2:8000": 1}}}"#;
    let ms = weighted_ms(named, &table);
    assert!(ms[1] > 2.9 * ms[0], "{ms:?}");
}

#[test]
fn a_weights_rate_stays_within_eight_times_the_configured_one() {
    let far = r#"{"cost": {"first_token_steps": 0, "speed_weights": {"10.0.0.1:8000": 100,
        "10.0.0.4:8000": 0.01}}}"#;
    let ms = weighted_ms(far, &table_of(4));
    // Typical weight 1 at the configured 20k tokens/s: 160k and 2.5k at most and least.
    let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert!(near(ms[0], 7.5) && near(ms[1], 60.0) && near(ms[3], 480.0), "{ms:?}");
}

#[test]
fn equal_or_near_weights_change_nothing() {
    let plain = weighted_ms(r#"{"cost": {"first_token_steps": 0}}"#, &table_of(4));
    assert_eq!(plain, [60.0; 4]);
    let all_two = r#"{"cost": {"first_token_steps": 0, "speed_weights": {"10.0.0.1:8000": 2,
        "10.0.0.2:8000": 2, "10.0.0.3:8000": 2, "10.0.0.4:8000": 2}}}"#;
    assert_eq!(weighted_ms(all_two, &table_of(4)), plain);
    let near = r#"{"cost": {"first_token_steps": 0, "speed_weights": {"10.0.0.1:8000": 1.4}}}"#;
    assert_eq!(weighted_ms(near, &table_of(4)), plain, "within 1.5x counts as alike");
    let off = r#"{"cost": {"first_token_steps": 0, "learn_speeds": false, "speed_weights":
        {"10.0.0.1:8000": 3, "10.0.0.2:8000": 3}}}"#;
    assert_eq!(weighted_ms(off, &table_of(4)), plain, "the configured rate alone");
}

#[test]
fn like_servers_are_scored_at_their_class_rate() {
    // Four H100s whose learned rates drifted apart (the outer two 1.7x apart) and four
    // A100s, 3x slower (`RateClasses`).
    let rates = [
        30_000.0, 38_000.0, 44_000.0, 51_000.0, 10_000.0, 11_500.0, 12_000.0, 14_000.0,
    ];
    let config = Config::from_json(b"{}").unwrap();
    let mut table = table_of(8);
    for (row, rate) in rates.iter().enumerate() {
        table.rows_mut()[row].speed = crate::speed::Speed::exact(*rate, Millis(0));
    }
    let idle = VllmMetrics::default();
    let cands = idle_cands(&table, &idle, 1200);
    let ctx = ctx_at_zero(rate_classes(&config, &cands, Millis(0)), None);
    let off = Config::from_json(br#"{"cost": {"first_token_steps": 0}}"#).unwrap();
    let ms: Vec<f64> = cands.iter().map(|c| predicted_ttft(&off, c, &ctx).ttft_ms).collect();
    assert!(ms[..4].iter().all(|m| (m - 1200.0 / 44.0).abs() < 1e-9), "{ms:?}");
    assert!(
        ms[4..].iter().all(|m| (m - 100.0).abs() < 1e-9),
        "1200 tokens at 12k/s: {ms:?}"
    );
}

#[test]
fn a_learned_rate_gives_way_to_a_pace_far_off_it() {
    let config = Config::from_json(b"{}").unwrap();
    let mut table = table_of(3);
    // All three learned 40k tokens/s from vLLM's sums; then the third slowed 3x: its
    // first tokens show it at once, its sums only when its requests finish. The first
    // reads 3x faster than the median pace: a pace never speeds a learned rate up.
    for (row, ms) in [(0, 50), (1, 150), (2, 450)] {
        table.rows_mut()[row].speed = crate::speed::Speed::exact(40_000.0, Millis(0));
        for _ in 0..PrefillPace::PLACE_SAMPLES {
            table.rows_mut()[row].pace.observe(3000, 3000.0, ms, true, Millis(0));
        }
    }
    let idle = VllmMetrics::default();
    let cands = idle_cands(&table, &idle, 1000);
    let ctx = ctx_at_zero(
        rate_classes(&config, &cands, Millis(0)),
        typical_pace(&config, &cands, Millis(0)),
    );
    let [fast, near, slow] = cands
        .iter()
        .map(|c| predicted_ttft(&config, c, &ctx).ttft_ms)
        .collect::<Vec<_>>()[..]
    else {
        panic!()
    };
    assert!(
        (fast - 25.0).abs() < 1e-9 && fast == near,
        "1000 tokens at the learned 40k/s: {fast}, {near}"
    );
    assert!(
        (slow / near - 3.0).abs() < 1e-9,
        "3x the median pace: its pace ({slow} vs {near})"
    );
}

#[test]
fn a_server_known_by_its_pace_alone_is_scored_against_the_servers_whose_rate_is_learned() {
    let config = Config::from_json(b"{}").unwrap();
    let mut table = table_of(7);
    // Three H100s have learned 40k tokens/s and their first tokens came at that pace. Four
    // A100s, 3.3x slower, have no learned rate yet (vLLM's sums wait for their requests to
    // finish); they are the majority, so the median pace is theirs.
    for row in 0..7 {
        let ms = if row < 4 { 250 } else { 75 };
        if row >= 4 {
            table.rows_mut()[row].speed = crate::speed::Speed::exact(40_000.0, Millis(0));
        }
        for _ in 0..PrefillPace::PLACE_SAMPLES {
            table.rows_mut()[row].pace.observe(3000, 3000.0, ms, true, Millis(0));
        }
    }
    let idle = VllmMetrics::default();
    let cands = idle_cands(&table, &idle, 1000);
    let rates = rate_classes(&config, &cands, Millis(0));
    let per_pace = rate_per_pace(&config, &cands, &rates, Millis(0));
    let ctx = ScoreContext {
        rate_per_pace: per_pace,
        ..ctx_at_zero(rates, typical_pace(&config, &cands, Millis(0)))
    };
    let ms: Vec<f64> = cands.iter().map(|c| predicted_ttft(&config, c, &ctx).ttft_ms).collect();
    // 1000 tokens at 40k/s on an H100; at 40k x 75 / 250 = 12k/s on an A100 (scaling the
    // learned rate by the A100s' own median pace read them at 40k/s too: 25 ms).
    assert!(ms[4..].iter().all(|m| (m - 25.0).abs() < 1e-9), "{ms:?}");
    assert!(ms[..4].iter().all(|m| (m - 1000.0 / 12.0).abs() < 1e-6), "{ms:?}");
    // With no learned rate anywhere, paces are placed against the median pace as before.
    let mut unlearned = table.clone();
    for row in 4..7 {
        unlearned.rows_mut()[row].speed = crate::speed::Speed::default();
    }
    let cands = idle_cands(&unlearned, &idle, 1000);
    assert_eq!(rate_per_pace(&config, &cands, &RateClasses::default(), Millis(0)), None);
}

#[test]
fn on_a_fleet_of_unlike_gpus_a_fast_server_with_its_kv_nearly_full_gives_way() {
    let config = Config::from_json(br#"{"cost": {"first_token_steps": 0}}"#).unwrap();
    // The H100's KV cache 95% full, the A100s' at 35%.
    // An H100 (39k tokens/s) beside two A100s (11.5k): a class of slower GPUs.
    let mut table = table_of(3);
    table.rows_mut()[0].speed = crate::speed::Speed::exact(39_000.0, Millis(0));
    for row in 1..3 {
        table.rows_mut()[row].speed = crate::speed::Speed::exact(11_500.0, Millis(0));
    }
    let each = |table: &'_ EndpointTable, metrics: [&'_ VllmMetrics; 3], uncached: u64| -> Vec<Terms> {
        let cands = cands_of(table, metrics, uncached);
        let ctx = ctx_at_zero(rate_classes(&config, &cands, Millis(0)), None);
        let ctx = ScoreContext {
            unlike: unlike_rates(&config, &cands, &ctx),
            ..ctx
        };
        cands.iter().map(|c| predicted_ttft(&config, c, &ctx)).collect()
    };
    let full = VllmMetrics {
        kv_usage: 0.95,
        running: 100,
        ..VllmMetrics::default()
    };
    let roomy = VllmMetrics {
        kv_usage: 0.35,
        running: 30,
        ..VllmMetrics::default()
    };
    let unlike = each(&table, [&full, &roomy, &roomy], 4800);
    // The unlike fleet's term: 1000 ms × ((0.95 − 0.7) / 0.3)²; the A100 is below 0.7.
    assert!(
        (unlike[0].kv_ms - 1000.0 * (0.25f64 / 0.3).powi(2)).abs() < 1e-9,
        "{unlike:?}"
    );
    assert_eq!(unlike[1].kv_ms, 0.0);
    assert!(unlike[1].cost < unlike[0].cost, "the A100 with room wins: {unlike:?}");
    // Two like GPUs: the like fleet's term, 200 ms × ((0.95 − 0.8) / 0.2)².
    for row in 1..3 {
        table.rows_mut()[row].speed = crate::speed::Speed::exact(39_000.0, Millis(0));
    }
    let like = each(&table, [&full, &roomy, &roomy], 4800);
    assert!(
        (like[0].kv_ms - 200.0 * (0.15f64 / 0.2).powi(2)).abs() < 1e-9,
        "{like:?}"
    );
    // Between the two thresholds (75%): charged on the unlike fleet only.
    let between = VllmMetrics {
        kv_usage: 0.75,
        ..VllmMetrics::default()
    };
    let at = |rate: f64| {
        let mut table = table_of(3);
        table.rows_mut()[0].speed = crate::speed::Speed::exact(39_000.0, Millis(0));
        for row in 1..3 {
            table.rows_mut()[row].speed = crate::speed::Speed::exact(rate, Millis(0));
        }
        each(&table, [&between, &between, &between], 1000)[0].kv_ms
    };
    assert!((at(11_500.0) - 1000.0 * (0.05f64 / 0.3).powi(2)).abs() < 1e-9);
    assert_eq!(at(39_000.0), 0.0);
}

#[test]
fn a_fleet_is_unlike_when_its_scored_rates_are_twice_apart_however_they_are_known() {
    let config = Config::from_json(b"{}").unwrap();
    let idle = VllmMetrics::default();
    let unlike = |config: &Config, table: &EndpointTable| {
        let cands = idle_cands(table, &idle, 1000);
        let mut ctx = ctx_at_zero(rate_classes(config, &cands, Millis(0)), None);
        ctx.typical_weight = typical_weight(config, &cands, &ctx.rates, Millis(0));
        unlike_rates(config, &cands, &ctx)
    };
    let learned = |rates: &[f64]| {
        let mut table = table_of(rates.len());
        for (row, rate) in rates.iter().enumerate() {
            table.rows_mut()[row].speed = crate::speed::Speed::exact(*rate, Millis(0));
        }
        table
    };
    assert!(
        !unlike(&config, &table_of(4)),
        "nothing learned: all at the configured rate"
    );
    assert!(
        !unlike(&config, &learned(&[30_000.0, 38_000.0, 44_000.0, 51_000.0])),
        "drifted H100s are one class"
    );
    assert!(
        !unlike(&config, &learned(&[10_000.0, 10_000.0, 16_000.0])),
        "1.6x apart"
    );
    assert!(unlike(&config, &learned(&[10_000.0, 10_000.0, 21_000.0])), "2.1x apart");
    assert!(unlike(&config, &learned(&[39_000.0, 39_000.0, 11_500.0, 11_500.0])));
    assert!(
        !unlike(&config, &learned(&[39_000.0, 39_000.0, 39_000.0, 11_500.0])),
        "one straggler is not a class of slower GPUs"
    );
    // Nothing learned yet, the speeds only weighted (a fleet that starts cold).
    let weighted = Config::from_json(H100_H100_A100_A100.as_bytes()).unwrap();
    assert!(unlike(&weighted, &table_of(4)));
    // Nothing learned, the speeds known from first tokens: two servers 2.7x slower than the
    // median pace (as in `a_server_with_no_learned_rate_is_placed_by_its_pace_...`).
    let mut paced = table_of(4);
    for (row, ms) in [(0, 100), (1, 150), (2, 400), (3, 400)] {
        for _ in 0..PrefillPace::PLACE_SAMPLES {
            paced.rows_mut()[row].pace.observe(3000, 3000.0, ms, true, Millis(0));
        }
    }
    let cands = idle_cands(&paced, &idle, 1000);
    let ctx = ctx_at_zero(RateClasses::default(), typical_pace(&config, &cands, Millis(0)));
    assert!(unlike_rates(&config, &cands, &ctx));
}

#[test]
fn a_server_whose_slots_hold_long_decodes_is_charged_the_wait_for_one_to_finish() {
    let config = Config::from_json(br#"{"cost": {"first_token_steps": 0}}"#).unwrap();
    let mut table = table_of(2);
    for row in 0..2 {
        table.rows_mut()[row].speed = crate::speed::Speed::exact(11_500.0, Millis(0));
    }
    // Server 0's 256 sequence slots are full and 8 prompts wait; it finishes 5 requests a
    // second. Server 1 runs 900 of its 1,024 slots and nothing waits there: its longer
    // decode steps made it look the worse.
    table.rows_mut()[0].completions = crate::speed::Completions::exact(5.0);
    table.rows_mut()[0].completions.on_queue(256, 8);
    table.rows_mut()[1].completions = crate::speed::Completions::exact(5.0);
    let slot_bound = VllmMetrics {
        kv_usage: 0.3,
        running: 256,
        waiting: 8,
        ..VllmMetrics::default()
    };
    let free = VllmMetrics {
        kv_usage: 0.5,
        running: 900,
        ..VllmMetrics::default()
    };
    let cands = cands_of(&table, [&slot_bound, &free], 128);
    let mut ctx = ctx_at_zero(rate_classes(&config, &cands, Millis(0)), None);
    ctx.mean_uncached_tokens = 128.0;
    // Charged on a fleet of unlike GPUs (these two stand for its slower ones) as on a like one.
    ctx.unlike = true;
    let terms: Vec<Terms> = cands.iter().map(|c| predicted_ttft(&config, c, &ctx)).collect();
    // Admitted after 9 completions at 5 a second: 1.8 s, of which the 8 queued prompts'
    // prefill (1,024 tokens at 11.5k a second) was already counted.
    assert!((admission_ms(&cands[0]) - 1800.0).abs() < 1e-9);
    let queued_ms = 8.0 * 128.0 * 1000.0 / 11_500.0;
    let own_ms = 128.0 * 1000.0 / 11_500.0;
    let decode_ms = 256.0 * 0.1 * 20_000.0 / 11_500.0;
    assert!(
        (terms[0].ttft_ms - (1800.0 + own_ms + decode_ms)).abs() < 1e-6,
        "{} against {queued_ms}",
        terms[0].ttft_ms
    );
    assert_eq!(admission_ms(&cands[1]), 0.0, "nothing waits");
    assert!(
        terms[1].cost < terms[0].cost,
        "the server with free slots wins: {terms:?}"
    );
    // Without the term (or without a known rate) the slot-bound server looked the better.
    let off = Config::from_json(br#"{"cost": {"first_token_steps": 0, "admission_weight": 0}}"#).unwrap();
    let terms: Vec<Terms> = cands.iter().map(|c| predicted_ttft(&off, c, &ctx)).collect();
    assert!(terms[0].cost < terms[1].cost, "{terms:?}");
    // Not on a like fleet, nor with tiers.
    let without = |config: &Config, ctx: &ScoreContext| {
        let t = predicted_ttft(config, &cands[0], ctx);
        (t.ttft_ms - (queued_ms + own_ms + decode_ms)).abs() < 1e-6
    };
    let tiered =
        Config::from_json(br#"{"cost": {"first_token_steps": 0}, "tiers": {"endpoints": {"10.0.0.2:8000": 1}}}"#)
            .unwrap();
    assert!(without(&tiered, &ctx));
    // On a like fleet too (servers of one kind fill their slots alike: 8 A100s at chat 60
    // req/s).
    let like = ScoreContext { unlike: false, ..ctx };
    assert!(!without(&config, &like));
    // But not where every candidate has requests queued: the fleet is past what it serves.
    let backlogged = ScoreContext {
        fleet_backlog: ADMISSION_BACKLOG,
        ..like
    };
    assert!(without(&config, &backlogged));
    let under = ScoreContext {
        fleet_backlog: ADMISSION_BACKLOG - 0.01,
        ..backlogged
    };
    assert!(!without(&config, &under));
    table.rows_mut()[0].completions = crate::speed::Completions::default();
    let cands = cands_of(&table, [&slot_bound, &free], 128);
    assert_eq!(admission_ms(&cands[0]), 0.0, "no rate yet");
}

#[test]
fn with_the_admission_wait_the_prediction_still_grows_with_the_queue() {
    let config = Config::from_json(b"{}").unwrap();
    let mut table = table_of(1);
    table.rows_mut()[0].speed = crate::speed::Speed::exact(11_500.0, Millis(0));
    table.rows_mut()[0].completions = crate::speed::Completions::exact(5.0);
    for mean_uncached in [0.0, 128.0, 4800.0] {
        for running in [100, 256, 900] {
            let mut last = 0.0;
            for waiting in 0..64 {
                let m = VllmMetrics {
                    kv_usage: 0.5,
                    running,
                    waiting,
                    ..VllmMetrics::default()
                };
                let cands = cands_of(&table, [&m], 512);
                let mut ctx = ctx_at_zero(rate_classes(&config, &cands, Millis(0)), None);
                (ctx.mean_uncached_tokens, ctx.unlike) = (mean_uncached, true);
                let ms = predicted_ttft(&config, &cands[0], &ctx).ttft_ms;
                assert!(ms >= last, "{mean_uncached} {running} {waiting}: {ms} < {last}");
                last = ms;
            }
        }
    }
}

#[test]
fn a_server_nothing_is_known_of_is_scored_as_the_fastest_class() {
    let config = Config::from_json(b"{}").unwrap();
    // Four A100s (11.5k tokens/s) and three H100s (39k) have learned their rates; the last
    // server just joined: no learned rate, no first token yet, no weight.
    let mut table = table_of(8);
    for row in 0..7 {
        let rate = if row < 4 { 11_500.0 } else { 39_000.0 };
        table.rows_mut()[row].speed = crate::speed::Speed::exact(rate, Millis(0));
    }
    let idle = VllmMetrics::default();
    let cands = idle_cands(&table, &idle, 1000);
    let rates = rate_classes(&config, &cands, Millis(0));
    let typical = rates.typical().unwrap();
    assert!(
        (typical - 11_500.0).abs() < 1e-6,
        "the fleet's median is an A100: {typical}"
    );
    let ctx = ctx_at_zero(rates, typical_pace(&config, &cands, Millis(0)));
    let ms: Vec<f64> = cands.iter().map(|c| predicted_ttft(&config, c, &ctx).ttft_ms).collect();
    // Scored at the typical rate it read as an A100, drew no prompt beside the idle H100s
    // and never showed what it is.
    assert!((ms[7] - ms[4]).abs() < 1e-9, "{ms:?}");
    assert!(ms[0] > 3.0 * ms[7], "{ms:?}");
}
