use super::*;

fn chat(body: &str) -> Result<ParsedRequest, RequestError> {
    parse(ApiKind::Chat, body.as_bytes())
}

fn completion(body: &str) -> Result<ParsedRequest, RequestError> {
    parse(ApiKind::Completions, body.as_bytes())
}

#[test]
fn chat_string_and_part_contents_give_the_same_canonical_text() {
    let plain = chat(r#"{"model":"m","messages":[{"role":"user","content":"hello world"}]}"#).unwrap();
    let parts = chat(
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hello "},{"type":"text","text":"world"}]}]}"#,
    )
    .unwrap();
    assert_eq!(plain.canonical, parts.canonical);
    assert_eq!(plain.canonical, b"user\x1fhello world\x1e");
    assert_eq!(plain.prompt_tokens, Tokens(5 + 4)); // 17 bytes -> 5 tokens, + 4 per message
}

#[test]
fn tools_come_first_with_sorted_keys_whatever_the_client_order() {
    let a = chat(r#"{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],"messages":[{"role":"user","content":"x"}]}"#)
        .unwrap();
    let b = chat(r#"{"model":"m","tools":[{"function":{"name":"f"},  "type":"function"}],"messages":[{"role":"user","content":"x"}]}"#)
        .unwrap();
    assert_eq!(a.canonical, b.canonical);
    assert!(a
        .canonical
        .starts_with(br#"[{"function":{"name":"f"},"type":"function"}]"#));
}

#[test]
fn image_parts_are_part_of_the_prefix() {
    let one =
        chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a"}}]}]}"#)
            .unwrap();
    let two =
        chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"b"}}]}]}"#)
            .unwrap();
    assert_ne!(one.canonical, two.canonical);
}

#[test]
fn an_image_counts_a_fixed_number_of_tokens_whatever_its_encoding() {
    let image = |url: &str| {
        chat(&format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"what is this?"}},{{"type":"image_url","image_url":{{"url":"{url}"}}}}]}}]}}"#
        ))
        .unwrap()
    };
    let by_url = image("https://example.com/cat.png");
    let inline = image(&format!("data:image/png;base64,{}", "A".repeat(200_000)));
    // "user" + 0x1f + "what is this?" + 0x1e: 19 bytes, 5 tokens; 4 for the message.
    assert_eq!(by_url.prompt_tokens, Tokens(5 + 4 + TOKENS_PER_MEDIA_PART));
    assert_eq!(inline.prompt_tokens, by_url.prompt_tokens);
    assert_ne!(inline.canonical, by_url.canonical, "still part of the prefix");
}

#[test]
fn sampling_fields_are_read() {
    let r = chat(
        r#"{"model":"llama","messages":[{"role":"system","content":null},{"role":"user","content":"q"}],
            "max_tokens":10,"max_completion_tokens":20,"stream":true,"user":"u1","cache_salt":"s"}"#,
    )
    .unwrap();
    assert_eq!(r.model, "llama");
    assert_eq!(
        r.max_tokens,
        Some(20),
        "max_completion_tokens wins over the legacy max_tokens"
    );
    assert!(r.stream);
    assert_eq!(r.user.as_deref(), Some("u1"));
    assert_eq!(r.cache_salt.as_deref(), Some("s"));
}

#[test]
fn usage_is_expected_in_whole_responses_and_in_streams_that_ask_for_it() {
    let body = |extra: &str| format!(r#"{{"model":"m","messages":[{{"role":"user","content":"q"}}]{extra}}}"#);
    assert!(chat(&body("")).unwrap().reports_usage);
    assert!(chat(&body(r#","stream":false"#)).unwrap().reports_usage);
    assert!(!chat(&body(r#","stream":true"#)).unwrap().reports_usage);
    assert!(
        !chat(&body(r#","stream":true,"stream_options":{"include_usage":false}"#))
            .unwrap()
            .reports_usage
    );
    assert!(
        chat(&body(r#","stream":true,"stream_options":{"include_usage":true}"#))
            .unwrap()
            .reports_usage
    );
    // An odd stream_options is not a reason to refuse routing.
    assert!(
        !chat(&body(r#","stream":true,"stream_options":"yes""#))
            .unwrap()
            .reports_usage
    );
}

#[test]
fn completion_prompt_forms() {
    let s = completion(r#"{"model":"m","prompt":"abcdefgh"}"#).unwrap();
    assert_eq!((s.canonical.as_slice(), s.prompt_tokens), (&b"abcdefgh"[..], Tokens(2)));
    let batch = completion(r#"{"model":"m","prompt":["abcd","efghijkl"]}"#).unwrap();
    assert_eq!(
        (batch.canonical.as_slice(), batch.prompt_tokens),
        (&b"abcd"[..], Tokens(3))
    );
    let ids = completion(r#"{"model":"m","prompt":[1,2,258]}"#).unwrap();
    assert_eq!(ids.canonical, vec![1, 0, 0, 0, 2, 0, 0, 0, 2, 1, 0, 0]);
    assert_eq!(ids.prompt_tokens, Tokens(3));
    let id_batch = completion(r#"{"model":"m","prompt":[[1,2],[3,4,5]]}"#).unwrap();
    assert_eq!(id_batch.prompt_tokens, Tokens(5));
}

#[test]
fn malformed_bodies_say_what_is_wrong() {
    assert!(matches!(chat("{"), Err(RequestError::Malformed(_))));
    assert!(matches!(chat("[]"), Err(RequestError::Malformed(_))));
    assert_eq!(chat(r#"{"model":"m"}"#), Err(RequestError::MissingField("messages")));
    assert!(matches!(
        chat(r#"{"model":"m","messages":[]}"#),
        Err(RequestError::InvalidField { field: "messages", .. })
    ));
    assert!(matches!(
        chat(r#"{"model":"m","messages":[{"role":"user","content":5}]}"#),
        Err(RequestError::InvalidField { .. })
    ));
    assert!(matches!(
        completion(r#"{"model":"m","prompt":5}"#),
        Err(RequestError::Malformed(ref e)) if e.contains("an array of token ids")
    ));
    assert!(matches!(
        completion(r#"{"model":"m","prompt":[-1]}"#),
        Err(RequestError::Malformed(ref e)) if e.contains("token ids must be integers")
    ));
    assert!(matches!(
        completion(r#"{"model":"m","prompt":["a", 1]}"#),
        Err(RequestError::Malformed(ref e)) if e.contains("mixes kinds")
    ));
    assert!(matches!(
        completion(r#"{"model":7,"prompt":"a"}"#),
        Err(RequestError::Malformed(_))
    ));
    assert!(matches!(
        parse(ApiKind::Chat, &[b'"', 0xff, b'"']),
        Err(RequestError::Malformed(_))
    ));
}

#[test]
fn deeply_nested_json_is_an_error_not_a_crash() {
    let deep = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"tools":{}{}}}"#,
        "[".repeat(10_000),
        "]".repeat(10_000)
    );
    assert!(matches!(chat(&deep), Err(RequestError::Malformed(_))));
}

#[test]
fn paths_select_the_api() {
    assert_eq!(ApiKind::from_path("/v1/chat/completions"), Some(ApiKind::Chat));
    assert_eq!(ApiKind::from_path("/v1/completions?x=1"), Some(ApiKind::Completions));
    assert_eq!(ApiKind::from_path("/v1/models"), None);
    assert_eq!(ApiKind::from_path("/v1/chat/completions/extra"), None);
}

#[test]
fn duplicate_keys_are_rejected_not_merged() {
    let dup = chat(r#"{"model":"a","model":"b","messages":[{"role":"user","content":"x"}]}"#);
    assert!(
        matches!(dup, Err(RequestError::Malformed(ref e)) if e.contains("duplicate field")),
        "{dup:?}"
    );
}

#[test]
fn more_messages_than_the_cap_are_refused_early_and_the_cap_itself_parses() {
    let one = r#"{"role":"user","content":"hi"},"#;
    let body = |n: usize| {
        format!(
            r#"{{"model":"m","messages":[{}{{"role":"user","content":"end"}}]}}"#,
            one.repeat(n)
        )
    };
    let r = chat(&body(MAX_MESSAGES - 1)).unwrap();
    assert!(r.prompt_tokens.0 > 4 * MAX_MESSAGES as u64, "{:?}", r.prompt_tokens);
    let err = chat(&body(100_000)).unwrap_err();
    assert!(
        matches!(err, RequestError::Malformed(ref e) if e.contains("more than 4096 messages")),
        "{err:?}"
    );
}

#[test]
fn token_id_prompts_stay_compact_and_batches_keep_only_the_first() {
    let ids = completion(&format!(r#"{{"model":"m","prompt":[{}7]}}"#, "1,".repeat(100_000))).unwrap();
    assert_eq!(ids.prompt_tokens, Tokens(100_001));
    assert_eq!(ids.canonical.len(), 4 * 100_001);
    let too_big = completion(r#"{"model":"m","prompt":[4294967296]}"#).unwrap_err();
    assert!(
        matches!(too_big, RequestError::Malformed(ref e) if e.contains("0..2^32")),
        "{too_big:?}"
    );
    assert!(matches!(
        completion(r#"{"model":"m","prompt":[[1],"a"]}"#),
        Err(RequestError::Malformed(_))
    ));
    assert!(matches!(
        completion(r#"{"model":"m","prompt":[1.5]}"#),
        Err(RequestError::Malformed(_))
    ));
}

#[test]
fn bodies_vllm_accepts_are_routed_not_skipped() {
    let no_model = chat(r#"{"messages":[{"role":"user","content":"q"}]}"#).unwrap();
    assert_eq!(no_model.model, "", "routed under the empty model name");
    let null_stream = chat(r#"{"model":"m","stream":null,"messages":[{"role":"user","content":"q"}]}"#).unwrap();
    assert!(!null_stream.stream);
    let float = completion(r#"{"model":"m","prompt":"p","max_tokens":5.0,"stream":"true"}"#).unwrap();
    assert_eq!((float.max_tokens, float.stream), (Some(5), true));
    let text = completion(r#"{"model":"m","prompt":"p","max_tokens":"7"}"#).unwrap();
    assert_eq!(text.max_tokens, Some(7));
    let null_model = chat(r#"{"model":null,"messages":[{"role":"user","content":"q"}]}"#).unwrap();
    assert_eq!(null_model.model, "");
}

#[test]
fn values_vllm_rejects_are_left_to_the_server_not_a_parse_error() {
    for max_tokens in ["0", "-3", "1.5", "{}", "[1]", "\"many\"", "null"] {
        let body =
            format!(r#"{{"model":"m","prompt":"p","max_tokens":{max_tokens},"max_completion_tokens":{max_tokens}}}"#);
        let r = completion(&body).unwrap_or_else(|e| panic!("{max_tokens}: {e}"));
        assert_eq!(r.max_tokens, None, "{max_tokens}");
    }
    let odd_stream = chat(r#"{"model":"m","stream":{"x":1},"messages":[{"role":"user","content":"q"}]}"#).unwrap();
    assert!(!odd_stream.stream);
}

#[test]
fn include_usage_is_read_as_leniently_as_stream() {
    for flag in ["true", "\"true\"", "1", "\"yes\""] {
        let body = format!(
            r#"{{"model":"m","stream":true,"stream_options":{{"include_usage":{flag}}},"messages":[{{"role":"user","content":"x"}}]}}"#
        );
        assert!(chat(&body).unwrap().reports_usage, "{flag}");
    }
    let off = r#"{"model":"m","stream":true,"stream_options":{"include_usage":"false"},"messages":[{"role":"user","content":"x"}]}"#;
    assert!(!chat(off).unwrap().reports_usage);
}

#[test]
fn a_batch_of_prompts_leaves_its_usage_unread() {
    // vLLM reports the cached tokens of one prompt of a batch, not of the first (the one
    // routed on): nothing to learn from.
    for (prompt, read) in [
        (r#""one""#, true),
        (r#"["one"]"#, true),
        (r#"["one", "two"]"#, false),
        ("[1, 2, 3]", true),
        ("[[1, 2]]", true),
        ("[[1, 2], [3]]", false),
    ] {
        let body = format!(r#"{{"model":"m","prompt":{prompt}}}"#);
        assert_eq!(completion(&body).unwrap().reports_usage, read, "{prompt}");
    }
}

fn responses(body: &str) -> Result<ParsedRequest, RequestError> {
    parse(ApiKind::Responses, body.as_bytes())
}

#[test]
fn a_responses_body_reads_as_the_chat_it_stands_for() {
    let chat_body =
        chat(r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hello"}]}"#)
            .unwrap();
    let text = responses(r#"{"model":"m","instructions":"be brief","input":"hello","max_output_tokens":7}"#).unwrap();
    let items = responses(
        r#"{"model":"m","instructions":"be brief","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"hel"},{"type":"input_text","text":"lo"}]}]}"#,
    )
    .unwrap();
    assert_eq!(text.canonical, chat_body.canonical);
    assert_eq!(items.canonical, chat_body.canonical);
    assert_eq!(text.prompt_tokens, chat_body.prompt_tokens);
    assert_eq!(text.max_tokens, Some(7));
    assert!(text.stores, "store defaults to true");
    assert!(text.reports_usage && !text.stream && text.continues.is_none());
    let streamed = responses(r#"{"model":"m","input":"x","stream":true,"store":false}"#).unwrap();
    assert!(
        streamed.reports_usage,
        "a Responses stream ends with usage without being asked"
    );
    assert!(!streamed.stores);
    assert!(!responses(r#"{"model":"m","input":"x","store":null}"#).unwrap().stores);
}

#[test]
fn a_responses_continuation_names_its_stored_response_and_reads_no_usage() {
    let r = responses(r#"{"model":"m","input":"more","previous_response_id":"resp_42"}"#).unwrap();
    assert_eq!(r.continues.as_deref(), Some("resp_42"));
    assert!(!r.reports_usage, "its usage counts a history the filter never saw");
    // Chat bodies never continue anything, whatever fields they carry.
    let c =
        chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"previous_response_id":"resp_1"}"#).unwrap();
    assert_eq!(c.continues, None);
    assert!(!c.stores);
}

#[test]
fn responses_items_other_than_messages_count_as_their_json() {
    let a = responses(
        r#"{"model":"m","input":[{"role":"user","content":"q"},{"type":"function_call_output","call_id":"c1","output":"42"}]}"#,
    )
    .unwrap();
    let b = responses(
        r#"{"model":"m","input":[{"role":"user","content":"q"},{"type":"function_call_output","call_id":"c1","output":"43"}]}"#,
    )
    .unwrap();
    assert_ne!(a.canonical, b.canonical);
    assert!(a.canonical.starts_with(b"user\x1fq\x1efunction_call_output\x1f"));
}

#[test]
fn a_responses_body_vllm_would_refuse_is_not_routed() {
    for body in [
        r#"{"model":"m"}"#,
        r#"{"model":"m","input":[]}"#,
        r#"{"model":"m","input":5}"#,
        r#"{"model":"m","input":["x"]}"#,
        r#"{"model":"m","input":"x","instructions":{"a":1}}"#,
    ] {
        assert!(responses(body).is_err(), "{body}");
    }
}

#[test]
fn paths_about_a_stored_response_name_it() {
    assert_eq!(ApiKind::from_path("/v1/responses?x=1"), Some(ApiKind::Responses));
    assert_eq!(stored_response_path("/v1/responses/resp_1"), Some("resp_1"));
    assert_eq!(stored_response_path("/v1/responses/resp_1/cancel"), Some("resp_1"));
    assert_eq!(stored_response_path("/v1/responses/resp_1?stream=true"), Some("resp_1"));
    assert_eq!(stored_response_path("/v1/responses"), None);
    assert_eq!(stored_response_path("/v1/responses/"), None);
    assert_eq!(stored_response_path("/v1/responses/a/b"), None);
    assert_ne!(response_key("resp_1"), response_key("resp_2"));
}

#[test]
fn a_background_response_reads_no_usage_and_responses_fields_leave_chat_alone() {
    let bg = responses(r#"{"model":"m","input":"x","background":true}"#).unwrap();
    assert!(!bg.reports_usage, "vLLM answers a background request before any work");
    // A chat body carrying Responses fields of any type is read as before.
    let c = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"previous_response_id":7,"input":{},"instructions":[1]}"#)
        .unwrap();
    assert_eq!(c.canonical, b"user\x1fx\x1e");
}

#[test]
fn responses_input_items_are_bounded_like_chat_messages() {
    let items = |n: usize| vec![r#"{"role":"user","content":"x"}"#; n].join(",");
    let at_limit = format!(r#"{{"model":"m","input":[{}]}}"#, items(MAX_MESSAGES));
    assert!(responses(&at_limit).is_ok());
    let past = format!(r#"{{"model":"m","input":[{}]}}"#, items(MAX_MESSAGES + 1));
    assert!(matches!(responses(&past), Err(RequestError::Malformed(_))));
}

fn messages(body: &str) -> Result<ParsedRequest, RequestError> {
    parse(ApiKind::Messages, body.as_bytes())
}

#[test]
fn an_anthropic_body_hashes_as_the_chat_request_vllm_makes_of_it() {
    let anthropic = messages(
        r#"{"model":"m","max_tokens":9,"system":[{"type":"text","text":"be "},{"type":"text","text":"brief"}],
            "tools":[{"name":"f","description":"d","input_schema":{"type":"object"}}],
            "messages":[{"role":"user","content":[{"type":"text","text":"hello"}]},
                        {"role":"assistant","content":[{"type":"text","text":"calling"},{"type":"tool_use","id":"t1","name":"f","input":{}}]},
                        {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"42"},{"type":"text","text":"and?"}]}]}"#,
    )
    .unwrap();
    let chat_body = chat(
        r#"{"model":"m","tools":[{"type":"function","function":{"name":"f","description":"d","parameters":{"type":"object"}}}],
            "messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hello"},
                        {"role":"assistant","content":"calling","tool_calls":[{"id":"t1","type":"function","function":{"name":"f","arguments":"{}"}}]},
                        {"role":"tool","tool_call_id":"t1","content":"42"},{"role":"user","content":"and?"}]}"#,
    )
    .unwrap();
    assert_eq!(anthropic.canonical, chat_body.canonical);
    assert_eq!(anthropic.prompt_tokens, chat_body.prompt_tokens);
    assert_eq!(anthropic.max_tokens, Some(9));
    assert!(
        anthropic.reports_usage,
        "every answer carries its usage (`response::usage`)"
    );
    assert!(!anthropic.usage_unasked);
}

#[test]
fn an_anthropic_body_vllm_would_refuse_is_not_routed() {
    for body in [
        r#"{"model":"m","max_tokens":5}"#,
        r#"{"model":"m","max_tokens":5,"messages":[]}"#,
        r#"{"model":"m","max_tokens":5,"messages":[{"content":"x"}]}"#,
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":5}]}"#,
        r#"{"model":"m","max_tokens":5,"system":5,"messages":[{"role":"user","content":"x"}]}"#,
    ] {
        assert!(messages(body).is_err(), "{body}");
    }
    assert_eq!(ApiKind::from_path("/v1/messages"), Some(ApiKind::Messages));
}

#[test]
fn an_anthropic_image_counts_as_the_chat_image_part_it_becomes() {
    let anthropic = messages(
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"text","text":"see"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBOR"}}]}]}"#,
    )
    .unwrap();
    let chat_body = chat(
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"see"},{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBOR"}}]}]}"#,
    )
    .unwrap();
    assert_eq!(anthropic.canonical, chat_body.canonical);
    assert_eq!(anthropic.prompt_tokens, chat_body.prompt_tokens);
    // A URL source is its URL.
    let by_url = messages(
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"text","text":"see"},{"type":"image","source":{"type":"url","url":"https://x/y.png"}}]}]}"#,
    )
    .unwrap();
    let chat_url = chat(
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"see"},{"type":"image_url","image_url":{"url":"https://x/y.png"}}]}]}"#,
    )
    .unwrap();
    assert_eq!(by_url.canonical, chat_url.canonical);
}

#[test]
fn claude_codes_attribution_block_is_left_out_of_the_prefix_as_vllm_leaves_it_out() {
    // Its `cch` hash changes with every request: kept, no two requests would share a block.
    let body = |cch: &str| {
        format!(
            r#"{{"model":"m","max_tokens":5,"system":[{{"type":"text","text":"x-anthropic-billing-header: cc_version=2.1.100; cc_entrypoint=cli; cch={cch};"}},{{"type":"text","text":"You are a coding agent."}}],"messages":[{{"role":"user","content":"hi"}}]}}"#
        )
    };
    let (a, b) = (messages(&body("eb6c6")).unwrap(), messages(&body("4e20a")).unwrap());
    assert_eq!(a.canonical, b.canonical);
    let chat_body = chat(
        r#"{"model":"m","messages":[{"role":"system","content":"You are a coding agent."},{"role":"user","content":"hi"}]}"#,
    )
    .unwrap();
    assert_eq!(a.canonical, chat_body.canonical);
    // A system message inside the conversation loses it too (a string that is the block,
    // whole); one left empty adds nothing.
    let inline = messages(
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"system","content":[{"type":"text","text":"x-anthropic-billing-header: cch=1;"},{"type":"text","text":"You are a coding agent."}]},{"role":"system","content":"x-anthropic-billing-header: cch=2;"},{"role":"user","content":"hi"}]}"#,
    )
    .unwrap();
    assert_eq!(inline.canonical, chat_body.canonical);
    // The top-level system string is kept whole, as vLLM keeps it.
    let string = messages(
        r#"{"model":"m","max_tokens":5,"system":"x-anthropic-billing-header: cch=3;","messages":[{"role":"user","content":"hi"}]}"#,
    )
    .unwrap();
    let kept = chat(
        r#"{"model":"m","messages":[{"role":"system","content":"x-anthropic-billing-header: cch=3;"},{"role":"user","content":"hi"}]}"#,
    )
    .unwrap();
    assert_eq!(string.canonical, kept.canonical);
}

#[test]
fn system_messages_lead_into_the_system_prompt_and_stay_in_place_later_as_vllm_places_them() {
    // Leading ones join the system prompt after a blank line; a later one stays where it
    // is, so the turn that gained it keeps the earlier turn's prompt as its prefix (vLLM
    // leaves it there or folds it into the neighbouring user turn: either way its cache
    // keeps the prefix).
    let anthropic = messages(
        r#"{"model":"m","max_tokens":5,"system":"You are terse.","messages":[{"role":"system","content":"Use tools."},{"role":"user","content":"hi"},{"role":"assistant","content":"hello"},{"role":"user","content":"more"},{"role":"system","content":"Answer in French."}]}"#,
    )
    .unwrap();
    let chat_body = chat(
        r#"{"model":"m","messages":[{"role":"system","content":"You are terse.\n\nUse tools."},{"role":"user","content":"hi"},{"role":"assistant","content":"hello"},{"role":"user","content":"more"},{"role":"system","content":"Answer in French."}]}"#,
    )
    .unwrap();
    assert_eq!(anthropic.canonical, chat_body.canonical);
    assert_eq!(anthropic.prompt_tokens, chat_body.prompt_tokens);
    let earlier = messages(
        r#"{"model":"m","max_tokens":5,"system":"You are terse.","messages":[{"role":"system","content":"Use tools."},{"role":"user","content":"hi"}]}"#,
    )
    .unwrap();
    assert!(
        anthropic.canonical.starts_with(&earlier.canonical),
        "the later turn's prompt extends the earlier one's"
    );
}

#[test]
fn a_system_message_between_a_tool_call_and_its_results_follows_the_results() {
    let anthropic = messages(
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":{}}]},{"role":"system","content":"Be careful."},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"42"}]}]}"#,
    )
    .unwrap();
    let chat_body = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","tool_calls":[{"id":"t","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"t","content":"42"},{"role":"system","content":"Be careful."}]}"#,
    )
    .unwrap();
    assert_eq!(anthropic.canonical, chat_body.canonical);
}

#[test]
fn claude_codes_ctx_and_msg_roles_are_user_turns_as_vllm_reads_them() {
    let anthropic = messages(
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"ctx","content":"the repository"},{"role":"msg","content":[{"type":"text","text":"fix it"}]}]}"#,
    )
    .unwrap();
    let chat_body = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"the repository"},{"role":"user","content":"fix it"}]}"#,
    )
    .unwrap();
    assert_eq!(anthropic.canonical, chat_body.canonical);
}

#[test]
fn messages_without_content_are_kept_for_the_assistant_and_dropped_for_the_user() {
    // vLLM keeps an assistant turn whose blocks made no content (only thinking, here) and
    // drops such a user turn (only a tool_use, which a user cannot send, here).
    let anthropic = messages(
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"thinking","thinking":"hmm","signature":"s"}]},{"role":"user","content":[{"type":"tool_use","id":"t","name":"f","input":{}}]},{"role":"user","content":"well?"}]}"#,
    )
    .unwrap();
    let chat_body = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant"},{"role":"user","content":"well?"}]}"#,
    )
    .unwrap();
    assert_eq!(anthropic.canonical, chat_body.canonical);
    assert_eq!(anthropic.prompt_tokens, chat_body.prompt_tokens);
}

#[test]
fn an_assistants_tool_result_is_its_text_after_tool_result() {
    let anthropic = messages(
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"tool_result","tool_use_id":"t","content":"42"}]},{"role":"assistant","content":[{"type":"tool_result","tool_use_id":"u","content":[]}]}]}"#,
    )
    .unwrap();
    let chat_body = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Tool result: 42"},{"role":"assistant","content":"Tool result: "}]}"#,
    )
    .unwrap();
    assert_eq!(anthropic.canonical, chat_body.canonical);
}

#[test]
fn tools_a_tool_result_references_follow_it_as_a_tool_message() {
    // Claude Code's tool search: the referenced tools as vLLM passes them to the template.
    let anthropic = messages(
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"found"},{"type":"tool_reference","tool_name":"Bash"},{"type":"tool_reference","tool_name":null,"name":"Grep"}]}]}]}"#,
    )
    .unwrap();
    let chat_body = chat(
        r#"{"model":"m","messages":[{"role":"tool","tool_call_id":"t","content":"found"},{"role":"tool","tool_call_id":"t","content":[{"type":"tool_reference","name":"Bash"},{"type":"tool_reference","name":"Grep"}]}]}"#,
    )
    .unwrap();
    assert_eq!(anthropic.canonical, chat_body.canonical);
    assert_eq!(anthropic.prompt_tokens, chat_body.prompt_tokens);
    assert!(
        anthropic.prompt_tokens.0 < 100,
        "a tool reference is a few tokens of text, not a media part: {:?}",
        anthropic.prompt_tokens
    );
}

#[test]
fn images_vllm_skips_are_no_part_of_the_prompt() {
    // A message's image without a source, a tool result's `url` image without a URL.
    let anthropic = messages(
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"text","text":"see"},{"type":"image","source":{}},{"type":"image"}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"done"},{"type":"image","source":{"type":"url"}}]}]}]}"#,
    )
    .unwrap();
    let chat_body = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"see"},{"role":"tool","tool_call_id":"t","content":"done"}]}"#,
    )
    .unwrap();
    assert_eq!(anthropic.canonical, chat_body.canonical);
    assert_eq!(anthropic.prompt_tokens, chat_body.prompt_tokens);
}

#[test]
fn a_tool_schema_without_a_type_is_an_object_as_vllm_makes_it() {
    let anthropic = messages(
        r#"{"model":"m","max_tokens":5,"tools":[{"name":"f","input_schema":{"properties":{}}}],"messages":[{"role":"user","content":"hi"}]}"#,
    )
    .unwrap();
    let chat_body = chat(
        r#"{"model":"m","tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{}}}}],"messages":[{"role":"user","content":"hi"}]}"#,
    )
    .unwrap();
    assert_eq!(anthropic.canonical, chat_body.canonical);
}

#[test]
fn a_tool_result_of_blocks_is_its_text_joined_by_newlines_and_its_images_a_user_message() {
    let anthropic = messages(
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":[{"type":"text","text":"line one"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBOR"}},{"type":"text","text":"line two"}]},{"type":"text","text":"and?"}]}]}"#,
    )
    .unwrap();
    let chat_body = chat(
        r#"{"model":"m","messages":[{"role":"tool","tool_call_id":"t1","content":"line one\nline two"},
            {"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBOR"}}]},
            {"role":"user","content":"and?"}]}"#,
    )
    .unwrap();
    assert_eq!(anthropic.canonical, chat_body.canonical);
    assert_eq!(anthropic.prompt_tokens, chat_body.prompt_tokens);
}
