//! A 60-second soak in `make test` (the 30-minute one is `make soak`).

#[test]
fn a_minute_of_steady_traffic_loses_nothing_and_grows_nothing() {
    let r = kvroute_wasm_tests::soak::soak(60, 30.0).unwrap();
    eprintln!("{r:#?}");
    assert_eq!(r.failed, 0, "{r:?}");
    assert!(r.completed > 1500, "{r:?}");
    assert!(
        r.rss_growth() < 0.10,
        "Envoy RSS grew {:.1}% after warm-up",
        r.rss_growth() * 100.0
    );
    assert!(
        r.inflight_at_end <= 2,
        "requests still counted in flight: {}",
        r.inflight_at_end
    );
    // Summed over Envoy's 2 workers; the default budget is 64 MiB at 128 bytes an entry.
    assert!(r.index_entries > 0 && r.index_entries <= 2 * (64 << 20) / 128, "{r:?}");
}
