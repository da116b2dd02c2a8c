use super::*;

const LIMIT: usize = 1 << 20;
const V033: &str = include_str!("../../tests/fixtures/vllm_metrics_v0.33.txt");
const LEGACY: &str = include_str!("../../tests/fixtures/vllm_metrics_v0.6_legacy.txt");
const TWO: &str = include_str!("../../tests/fixtures/vllm_metrics_two_engines.txt");
const LORA: &str = include_str!("../../tests/fixtures/vllm_lora_info.txt");

fn parse(text: &str) -> Result<VllmMetrics, MetricsError> {
    parse_metrics(text.as_bytes(), LIMIT)
}

#[test]
fn vllm_0_33_reference_body_is_read() {
    let m = parse(V033).unwrap();
    assert_eq!((m.running, m.waiting, m.engines), (12, 3, 1));
    assert!((m.kv_usage - 0.4137).abs() < 1e-9);
    assert_eq!((m.block_size, m.num_gpu_blocks), (Some(16), Some(29205)));
    assert_eq!(m.capacity_tokens(), Some(467_280));
    assert_eq!((m.prefix_queries, m.prefix_hits), (Some(493_292.0), Some(315_392.0)));
    assert_eq!(m.prompt_tokens, Some(493_292.0), "vllm:prompt_tokens_total");
    // 447 stopped and 33 at their length: the finish reasons add up.
    assert_eq!(m.finished, Some(480.0), "vllm:request_success_total");
    assert_eq!(m.models, vec!["meta-llama/Llama-3.1-8B-Instruct".to_string()]);
    assert!(!m.legacy_names);
    // The step time sums: 755.5 s over 79,557 output tokens, 9.5 ms a step.
    assert_eq!((m.itl_seconds, m.itl_count), (Some(755.5064912777317), Some(79_557.0)));
}

#[test]
fn legacy_names_are_read_and_flagged() {
    let m = parse(LEGACY).unwrap();
    assert_eq!((m.running, m.waiting), (7, 21));
    assert!((m.kv_usage - 0.8731).abs() < 1e-9);
    assert_eq!(m.num_gpu_blocks, Some(27_000));
    assert_eq!((m.prefix_queries, m.prefix_hits), (Some(120_000.0), Some(49_200.0)));
    assert!(m.legacy_names);
    assert_eq!(m.finished, None, "no vllm:request_success_total there");
}

#[test]
fn engines_are_combined_with_kv_weighted_by_blocks() {
    let m = parse(TWO).unwrap();
    assert_eq!(
        m.finished,
        Some(100.0),
        "finished requests summed over engines and reasons"
    );
    assert_eq!((m.running, m.waiting, m.engines), (10, 3, 2));
    assert!((m.kv_usage - (0.2 * 10_000.0 + 0.5 * 30_000.0) / 40_000.0).abs() < 1e-9);
    assert_eq!(m.num_gpu_blocks, Some(40_000));
    assert_eq!((m.prefix_queries, m.prefix_hits), (Some(4000.0), Some(2000.0)));
}

#[test]
fn the_newest_lora_series_wins() {
    let body = format!("{V033}\n{LORA}");
    let lora = parse(&body).unwrap().lora.unwrap();
    assert_eq!(lora.max_lora, 4);
    assert_eq!(lora.running, vec!["sql-lora".to_string(), "chat-lora".to_string()]);
    assert_eq!(lora.waiting, vec!["tweet-lora".to_string()]);
}

#[test]
fn a_huge_adapter_list_or_block_count_is_bounded() {
    let names: Vec<String> = (0..10_000).map(|i| format!("a{i}")).collect();
    let bomb = format!(
        "vllm:lora_requests_info{{max_lora=\"4\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"\"}} 1.8e+09\n",
        names.join(",")
    );
    let lora = parse(&format!("{V033}\n{bomb}")).unwrap().lora.unwrap();
    assert_eq!(lora.running.len(), 64);
    // A block count near u64::MAX saturates instead of wrapping to a small capacity.
    let huge: String = V033
        .lines()
        .map(|l| {
            if l.starts_with("vllm:cache_config_info{") {
                let start = l.find("num_gpu_blocks=\"").unwrap() + "num_gpu_blocks=\"".len();
                let end = start + l[start..].find('"').unwrap();
                format!("{}{}{}", &l[..start], u64::MAX, &l[end..])
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let m = parse(&huge).unwrap();
    assert_eq!(m.capacity_tokens(), Some(u64::MAX));
}

#[test]
fn a_missing_required_family_is_named() {
    let no_waiting: String = V033
        .lines()
        .filter(|l| !l.starts_with("vllm:num_requests_waiting{"))
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(
        parse(&no_waiting),
        Err(MetricsError::MissingFamily("vllm:num_requests_waiting"))
    );
    assert_eq!(
        parse("# nothing here\nprocess_open_fds 6\n"),
        Err(MetricsError::MissingFamily("vllm:kv_cache_usage_perc"))
    );
    assert_eq!(parse(""), Err(MetricsError::MissingFamily("vllm:kv_cache_usage_perc")));
}

#[test]
fn out_of_range_gauges_are_rejected_not_clamped() {
    let bad = V033.replace(
        "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.4137",
        "vllm:kv_cache_usage_perc{engine=\"0\"} NaN",
    );
    assert!(matches!(
        parse(&bad),
        Err(MetricsError::InvalidValue {
            family: "vllm:kv_cache_usage_perc",
            ..
        })
    ));
    let neg = "vllm:kv_cache_usage_perc 0.1\nvllm:num_requests_running -1\nvllm:num_requests_waiting 0\n";
    assert!(matches!(parse(neg), Err(MetricsError::InvalidValue { .. })));
}

#[test]
fn size_cap_and_encoding_are_enforced() {
    assert_eq!(
        parse_metrics(V033.as_bytes(), 100),
        Err(MetricsError::TooLarge {
            bytes: V033.len(),
            limit: 100
        })
    );
    assert_eq!(parse_metrics(&[0xff, 0xfe], LIMIT), Err(MetricsError::NotUtf8));
}

#[test]
fn garbage_in_a_wanted_family_is_a_line_error() {
    let e = parse("vllm:num_requests_running{engine=\"0 5\n").unwrap_err();
    assert!(matches!(e, MetricsError::Line(LineError { line: 1, .. })), "{e:?}");
}

#[test]
fn too_many_engines_are_refused() {
    let mut body = String::new();
    for i in 0..=MAX_ENGINES {
        body.push_str(&format!("vllm:num_requests_running{{engine=\"{i}\"}} 1\n"));
    }
    assert_eq!(parse(&body), Err(MetricsError::TooManyEngines));
}

#[test]
fn minimal_body_without_labels_is_enough() {
    let m = parse("vllm:kv_cache_usage_perc 0.5\nvllm:num_requests_running 2\nvllm:num_requests_waiting 1\n").unwrap();
    assert_eq!((m.running, m.waiting, m.engines, m.num_gpu_blocks), (2, 1, 1, None));
}
