use super::*;

fn parse(json: &str) -> Result<Config, ConfigError> {
    Config::from_json(json.as_bytes())
}

#[test]
fn empty_document_gives_defaults() {
    let config = parse("").unwrap();
    assert_eq!(config.policy(), PolicyKind::Cost);
    assert_eq!(config.hashing().block_bytes, 256);
    assert_eq!(config.scrape().interval_ms, 200);
    assert_eq!(config.weighted().prefix, 3.0);
}

#[test]
fn unknown_field_is_rejected_with_its_name() {
    let err = parse(r#"{"polcy": "cost"}"#).unwrap_err();
    assert!(err.to_string().contains("polcy"), "{err}");
}

#[test]
fn a_value_of_the_wrong_type_or_sign_names_its_field() {
    for json in [
        r#"{"scrape": {"interval_ms": "200"}}"#,
        r#"{"scrape": {"interval_ms": -1}}"#,
    ] {
        let err = parse(json).unwrap_err();
        assert!(err.message.contains("at `scrape.interval_ms`"), "{json}: {err}");
    }
    let err = parse(r#"{"endpoints": ["10.0.0.1:8000", 7]}"#).unwrap_err();
    assert!(err.message.contains("at `endpoints[1]`"), "{err}");
}

#[test]
fn the_field_is_found_past_non_ascii_keys() {
    // serde_json counts columns in bytes; "é" is two.
    let err = parse(r#"{"cost": {"speed_weights": {"é": "x"}}}"#).unwrap_err();
    assert!(err.message.contains("at `cost.speed_weights.é`"), "{err}");
}

#[test]
fn an_unknown_key_in_a_section_names_the_section() {
    let err = parse(r#"{"overload": {"hold": {"max_wait": 100}}}"#).unwrap_err();
    assert!(
        err.message.contains("at `overload.hold.max_wait`") && err.message.contains("max_wait_ms"),
        "{err}"
    );
}

#[test]
fn trailing_text_after_the_document_is_rejected() {
    assert!(parse(r#"{"policy": "cost"} x"#).is_err());
}

#[test]
fn timeout_not_below_interval_names_both_values() {
    let err = parse(r#"{"scrape": {"interval_ms": 200, "timeout_ms": 500}}"#).unwrap_err();
    assert_eq!(err.field, "scrape.timeout_ms");
    assert!(err.message.contains("500") && err.message.contains("200"), "{err}");
}

#[test]
fn original_dst_without_a_pool_is_rejected() {
    let err = parse(r#"{"cluster_shape": "original_dst"}"#).unwrap_err();
    assert_eq!(err.field, "endpoints");
}

#[test]
fn malformed_and_duplicate_endpoints_are_rejected() {
    assert_eq!(parse(r#"{"endpoints": ["10.0.0.1"]}"#).unwrap_err().field, "endpoints");
    assert_eq!(
        parse(r#"{"endpoints": ["10.0.0.1:0"]}"#).unwrap_err().field,
        "endpoints"
    );
    assert_eq!(
        parse(r#"{"endpoints": ["10.0.0.1:1,10.0.0.2:2"]}"#).unwrap_err().field,
        "endpoints"
    );
    assert_eq!(
        parse(r#"{"endpoints": ["10.0.0.1:1", "10.0.0.1:1"]}"#)
            .unwrap_err()
            .field,
        "endpoints"
    );
    assert_eq!(
        parse(r#"{"endpoints": ["10.0.0.1:1", "[::1]:8000"]}"#)
            .unwrap()
            .endpoints()
            .len(),
        2
    );
}

#[test]
fn a_server_named_by_hostname_or_bare_ipv6_is_rejected_where_envoy_matches_addresses() {
    // Envoy's destination header and its hosts are IP:port; a hostname would match nothing
    // and every request would fall back to Envoy's own balancing.
    for (json, field) in [
        (r#"{"endpoints": ["vllm-0.vllm:8000"]}"#, "endpoints"),
        (r#"{"endpoints": ["::1:8000"]}"#, "endpoints"),
        (r#"{"tiers": {"endpoints": {"vllm-0:8000": 1}}}"#, "tiers.endpoints"),
        (
            r#"{"cost": {"speed_weights": {"10.0.0.1": 2.0}}}"#,
            "cost.speed_weights",
        ),
    ] {
        let err = parse(json).unwrap_err();
        assert_eq!(err.field, field, "{json}: {err}");
        assert!(err.message.contains("IP address and port"), "{err}");
    }
    assert!(parse(r#"{"tiers": {"endpoints": {"10.0.0.1:8000": 1}}}"#).is_ok());
}

#[test]
fn out_of_range_numbers_are_rejected() {
    assert_eq!(
        parse(r#"{"hashing": {"block_bytes": 4}}"#).unwrap_err().field,
        "hashing.block_bytes"
    );
    assert_eq!(
        parse(r#"{"cost": {"prefill_tokens_per_s": 0}}"#).unwrap_err().field,
        "cost.prefill_tokens_per_s"
    );
    assert_eq!(
        parse(r#"{"overload": {"kv_limit": 1.5}}"#).unwrap_err().field,
        "overload.kv_limit"
    );
    assert_eq!(
        parse(r#"{"weighted": {"queue": 0, "kv": 0, "prefix": 0}}"#)
            .unwrap_err()
            .field,
        "weighted"
    );
    assert_eq!(
        parse(r#"{"health": {"stale_after_ms": 100}}"#).unwrap_err().field,
        "health.stale_after_ms"
    );
    for (json, field) in [
        (r#"{"cost": {"progress_credit": 1.5}}"#, "cost.progress_credit"),
        (r#"{"cost": {"progress_credit": -0.1}}"#, "cost.progress_credit"),
        (r#"{"cost": {"attention_tokens": -1}}"#, "cost.attention_tokens"),
        (r#"{"cost": {"first_token_steps": -1}}"#, "cost.first_token_steps"),
        (r#"{"cost": {"holder_tolerance": 1.5}}"#, "cost.holder_tolerance"),
        (r#"{"cost": {"holder_min_share": -0.1}}"#, "cost.holder_min_share"),
        (r#"{"cost": {"served_tokens_kept": 1.5}}"#, "cost.served_tokens_kept"),
        (r#"{"cost": {"cold_balance": -1}}"#, "cost.cold_balance"),
        (r#"{"cost": {"storage_tolerance": 20}}"#, "cost.storage_tolerance"),
        (r#"{"cost": {"storage_fill": 1.5}}"#, "cost.storage_fill"),
        (r#"{"cost": {"storage_lost_share": -0.1}}"#, "cost.storage_lost_share"),
        (r#"{"cost": {"storage_depth": 1.5}}"#, "cost.storage_depth"),
        (r#"{"cost": {"cold_balance": 100}}"#, "cost.cold_balance"),
        (r#"{"cost": {"pending_weight": -0.5}}"#, "cost.pending_weight"),
        (
            r#"{"cost": {"kv_pressure_threshold": 1}}"#,
            "cost.kv_pressure_threshold",
        ),
        (
            r#"{"cost": {"kv_pressure_unlike_threshold": 1}}"#,
            "cost.kv_pressure_unlike_threshold",
        ),
        (
            r#"{"cost": {"kv_pressure_unlike_threshold": -0.1}}"#,
            "cost.kv_pressure_unlike_threshold",
        ),
        (
            r#"{"cost": {"kv_pressure_unlike_ms": -1}}"#,
            "cost.kv_pressure_unlike_ms",
        ),
        (r#"{"cost": {"admission_weight": -1}}"#, "cost.admission_weight"),
        (
            r#"{"cost": {"max_num_batched_tokens": 0}}"#,
            "cost.max_num_batched_tokens",
        ),
        (
            r#"{"cost": {"speed_weights": {"10.0.0.1:8000": 0}}}"#,
            "cost.speed_weights",
        ),
        (
            r#"{"cost": {"speed_weights": {"10.0.0.1:8000": -2}}}"#,
            "cost.speed_weights",
        ),
    ] {
        assert_eq!(parse(json).unwrap_err().field, field, "{json}");
    }
    assert!(parse(r#"{"cost": {"progress_credit": 0, "attention_tokens": 0}}"#).is_ok());
    assert!(parse(r#"{"cost": {"cold_balance": 0, "served_tokens_kept": 1, "pending_weight": 0}}"#).is_ok());
    assert!(parse(r#"{"cost": {"max_num_batched_tokens": 2048}}"#).is_ok());
    assert!(parse(r#"{"cost": {"kv_pressure_unlike_threshold": 0, "kv_pressure_unlike_ms": 0}}"#).is_ok());
    let e = parse(r#"{"cost": {"speed_weights": {"10.0.0.9:8000": 0}}}"#).unwrap_err();
    assert!(e.to_string().contains("10.0.0.9:8000"), "names the server: {e}");
}

#[test]
fn wrong_types_and_non_json_are_rejected() {
    assert!(parse(r#"{"policy": "fastest"}"#).is_err());
    assert!(parse(r#"{"fallbacks": "two"}"#).is_err());
    assert!(parse("not json").is_err());
    assert!(Config::from_json(&[0xff, 0xfe]).is_err());
}

#[test]
fn sharing_between_workers_is_on_by_default_and_its_timings_are_checked() {
    let c = Config::from_json(b"").unwrap();
    assert!(c.share().workers);
    assert_eq!(c.share().tick_ms, 2);
    assert_eq!(
        parse(r#"{"share": {"tick_ms": 0}}"#).unwrap_err().field,
        "share.tick_ms"
    );
    let e = parse(r#"{"share": {"tick_ms": 200, "peer_timeout_ms": 1500}}"#).unwrap_err();
    assert_eq!(e.field, "share.peer_timeout_ms");
    assert!(e.message.contains("10 × share.tick_ms"), "{e}");
    assert!(!parse(r#"{"share": {"workers": false}}"#).unwrap().share().workers);
}

#[test]
fn replicas_are_listed_or_discovered_and_need_a_real_secret() {
    let ok =
        r#"{"share": {"replicas": {"peers": ["10.0.0.1:10001", "10.0.0.2:10001"], "secret": "0123456789abcdef"}}}"#;
    let r = parse(ok).unwrap().share().replicas.clone().unwrap();
    assert_eq!(
        (r.cluster.as_str(), r.path.as_str(), r.interval_ms),
        ("kvroute_gateways", "/kvroute/v1/peer-events", 5)
    );
    assert!(
        r.at_once && r.from_workers && r.from_workers_per_s == 20,
        "placements within the ms, news from the workers at up to 20 POSTs a second each"
    );
    let off = parse(r#"{"share": {"replicas": {"secret": "0123456789abcdef", "from_workers": false}}}"#);
    assert!(!off.unwrap().share().replicas.as_ref().unwrap().from_workers);
    assert_eq!(
        parse(
            r#"{"share": {"replicas": {"secret": "0123456789abcdef", "from_workers": true, "from_workers_per_s": 0}}}"#
        )
        .unwrap_err()
        .field,
        "share.replicas.from_workers_per_s"
    );
    assert_eq!(
        parse(r#"{"share": {"replicas": {"peers": ["10.0.0.1:1"], "secret": "short"}}}"#)
            .unwrap_err()
            .field,
        "share.replicas.secret"
    );
    let listed = parse(ok).unwrap();
    assert!(!listed.discovers_replicas(), "listed peers are not discovered");
    let discovered = parse(r#"{"share": {"replicas": {"secret": "0123456789abcdef"}}}"#).unwrap();
    assert!(
        discovered.discovers_replicas(),
        "no peers: the hosts of share.replicas.cluster"
    );
    // The admin is asked for the replicas even when the pool is a static list.
    let static_pool = r#"{"endpoints": ["10.0.0.9:8000"], "discovery": {"admin_cluster": ""}, "share": {"replicas": {"#;
    assert_eq!(
        parse(&format!(r#"{static_pool}"secret": "0123456789abcdef"}}}}}}"#))
            .unwrap_err()
            .field,
        "discovery.admin_cluster"
    );
    assert!(
        parse(&format!(
            r#"{static_pool}"peers": ["10.0.0.1:1"], "secret": "0123456789abcdef"}}}}}}"#
        ))
        .is_ok(),
        "listed replicas and a static pool never ask the admin"
    );
    assert_eq!(
        parse(r#"{"share": {"replicas": {"peers": ["nope"], "secret": "0123456789abcdef"}}}"#)
            .unwrap_err()
            .field,
        "share.replicas.peers"
    );
    for peers in [r#"["gw-1.gw:10001"]"#, r#"["10.0.0.1:10001", "10.0.0.1:10001"]"#] {
        let json = format!(r#"{{"share": {{"replicas": {{"peers": {peers}, "secret": "0123456789abcdef"}}}}}}"#);
        assert_eq!(parse(&json).unwrap_err().field, "share.replicas.peers", "{peers}");
    }
    for pool in [r#""scrape": {"cluster": "gw"}"#, r#""discovery": {"cluster": "gw"}"#] {
        let json = format!(r#"{{{pool}, "share": {{"replicas": {{"cluster": "gw", "secret": "0123456789abcdef"}}}}}}"#);
        let e = parse(&json).unwrap_err();
        assert_eq!(e.field, "share.replicas.cluster", "{pool}: {e}");
        assert!(e.message.contains("vLLM servers"), "{e}");
    }
    let admin = r#"{"share": {"replicas": {"cluster": "kvroute_admin", "secret": "0123456789abcdef"}}}"#;
    let e = parse(admin).unwrap_err();
    assert!(
        e.field == "share.replicas.cluster" && e.message.contains("Envoy's admin"),
        "{e}"
    );
    assert!(
        parse(r#"{}"#).unwrap().share().replicas.is_none(),
        "off unless configured"
    );
}

#[test]
fn large_pools_are_scraped_less_often_but_never_past_staleness() {
    let c = Config::from_json(b"").unwrap();
    assert_eq!(c.scrape_interval_ms(4), 200);
    assert_eq!(c.scrape_interval_ms(128), 200);
    assert_eq!(c.scrape_interval_ms(256), 400);
    assert_eq!(c.scrape_interval_ms(10_000), 400, "40% of stale_after_ms");
    let unlimited = Config::from_json(br#"{"scrape": {"max_per_s": 0}}"#).unwrap();
    assert_eq!(unlimited.scrape_interval_ms(10_000), 200);
}

#[test]
fn capture_is_off_by_default_and_checked_when_on() {
    assert_eq!(parse("").unwrap().capture().sample, 0.0);
    let salt = r#""salt": "0123456789abcdef""#;
    let field = |json: &str| parse(json).unwrap_err().field;
    assert_eq!(field(r#"{"capture": {"sample": 1.5}}"#), "capture.sample");
    assert_eq!(field(r#"{"capture": {"sample": -0.1}}"#), "capture.sample");
    assert_eq!(
        field(r#"{"capture": {"sample": 1}}"#),
        "capture.salt",
        "a salt is required"
    );
    assert_eq!(field(r#"{"capture": {"sample": 1, "salt": "short"}}"#), "capture.salt");
    assert_eq!(
        field(&format!(
            r#"{{"capture": {{"sample": 1, {salt}, "block_bytes": 300}}}}"#
        )),
        "capture.block_bytes"
    );
    assert_eq!(
        field(&format!(r#"{{"capture": {{"sample": 1, {salt}, "property": "a b"}}}}"#)),
        "capture.property"
    );
    let ok = parse(&format!(
        r#"{{"capture": {{"sample": 0.5, {salt}, "block_bytes": 2048}}}}"#
    ))
    .unwrap();
    assert_eq!(ok.capture().block_bytes, 2048);
}

#[test]
fn holding_settings_are_checked_only_when_holding_is_on() {
    assert!(
        parse(r#"{"overload": {"hold": {"max_requests": 0}}}"#).is_ok(),
        "off: not checked"
    );
    for (json, field) in [
        (
            r#"{"overload": {"hold": {"max_wait_ms": 1000, "max_requests": 0}}}"#,
            "overload.hold.max_requests",
        ),
        (
            r#"{"overload": {"hold": {"max_wait_ms": 1000, "wait_limit_ms": 0}}}"#,
            "overload.hold.wait_limit_ms",
        ),
        (
            r#"{"overload": {"hold": {"max_wait_ms": 1000, "priority_weight": 0.5}}}"#,
            "overload.hold.priority_weight",
        ),
        (
            r#"{"overload": {"hold": {"max_wait_ms": 3600000}}}"#,
            "overload.hold.max_wait_ms",
        ),
        (
            r#"{"overload": {"hold": {"max_wait_ms": 1000, "newest_first_after_ms": 1000}}}"#,
            "overload.hold.newest_first_after_ms",
        ),
        (
            r#"{"overload": {"hold": {"max_wait_ms": 1000, "objective_wait_share": 1.5}}}"#,
            "overload.hold.objective_wait_share",
        ),
        (
            r#"{"overload": {"hold": {"max_wait_ms": 1000, "objective_wait_share": -0.5}}}"#,
            "overload.hold.objective_wait_share",
        ),
    ] {
        assert_eq!(parse(json).unwrap_err().field, field, "{json}");
    }
    assert!(parse(r#"{"overload": {"hold": {"max_wait_ms": 2000, "wait_limit_ms": 300}}}"#).is_ok());
    assert!(parse(r#"{"overload": {"hold": {"max_wait_ms": 1000, "newest_first_after_ms": 500}}}"#).is_ok());
}

#[test]
fn a_request_with_an_objective_waits_its_share_of_it_within_the_bound() {
    let c = parse(r#"{"overload": {"hold": {"max_wait_ms": 10000, "objective_wait_share": 0.5}}}"#).unwrap();
    let hold = &c.overload().hold;
    assert_eq!(hold.wait_bound_ms(None), 10_000, "no header: the bound");
    assert_eq!(hold.wait_bound_ms(Some(2_000.0)), 1_000);
    assert_eq!(hold.wait_bound_ms(Some(60_000.0)), 10_000, "never past max_wait_ms");
    assert_eq!(hold.wait_bound_ms(Some(0.4)), 1, "at least 1 ms");
    assert_eq!(hold.wait_bound_ms(Some(f64::NAN)), 10_000);
    let off = parse(r#"{"overload": {"hold": {"max_wait_ms": 10000}}}"#).unwrap();
    assert_eq!(
        off.overload().hold.wait_bound_ms(Some(2_000.0)),
        10_000,
        "share 0: the bound for all"
    );
    let none = parse(r#"{"overload": {"hold": {"max_wait_ms": 0, "objective_wait_share": 0.5}}}"#).unwrap();
    assert_eq!(none.overload().hold.wait_bound_ms(Some(2_000.0)), 0, "holding off");
}

#[test]
fn settings_that_would_do_nothing_or_harm_in_their_mode_are_rejected() {
    let secret = r#""secret": "0123456789abcdef""#;
    let replicas_alone =
        format!(r#"{{"share": {{"workers": false, "replicas": {{"peers": ["10.0.0.1:1"], {secret}}}}}}}"#);
    assert_eq!(parse(&replicas_alone).unwrap_err().field, "share.replicas");
    let weights = r#"{"endpoints": ["10.0.0.1:8000"], "cost": {"speed_weights_from_envoy": true}}"#;
    assert_eq!(parse(weights).unwrap_err().field, "cost.speed_weights_from_envoy");
    assert!(parse(r#"{"cost": {"speed_weights_from_envoy": true}}"#).is_ok());
    let lease = r#"{"endpoints": ["10.0.0.1:8000"], "discovery": {"lease_ms": 0}}"#;
    assert_eq!(parse(lease).unwrap_err().field, "discovery.lease_ms");
}

#[test]
fn metrics_must_outlive_a_round_of_scrapes() {
    // 200 ms apart, each answered within 150 ms: 201 ms would read stale between rounds.
    let err = parse(r#"{"health": {"stale_after_ms": 201}}"#).unwrap_err();
    assert_eq!(err.field, "health.stale_after_ms");
    assert!(err.message.contains("200 + 150"), "{err}");
    assert!(parse(r#"{"health": {"stale_after_ms": 351}}"#).is_ok());
    assert_eq!(
        parse(r#"{"health": {"eject_ms": 0}}"#).unwrap_err().field,
        "health.eject_ms"
    );
}

#[test]
fn a_retry_after_of_zero_is_rejected() {
    assert_eq!(
        parse(r#"{"overload": {"retry_after_s": 0}}"#).unwrap_err().field,
        "overload.retry_after_s"
    );
}
