//! Reading what vLLM reports back: `usage.prompt_tokens_details.cached_tokens`.
//!
//! The filter does not buffer responses (that would delay every token of a stream); it
//! keeps the last few KiB of the body as it passes and scans them here. `usage` is at the
//! end of a non-streaming body and in the last data event of a stream with
//! `stream_options.include_usage`, so the tail is enough. The scan takes the last
//! `"cached_tokens": <integer>` in the text and ignores anything it cannot read.
//!
//! vLLM writes `prompt_tokens_details` only when started with `--enable-prompt-tokens-details`
//! and only when some prompt tokens were cached: a miss has `usage` without it. So whether
//! `usage` came at all is reported too (`reports_usage`); the router reads "usage without
//! details" as 0 cached from a server that has shown details before.

const KEY: &[u8] = b"\"cached_tokens\"";
const USAGE: &[u8] = b"\"prompt_tokens\"";

/// Whether `tail` holds a `usage` object (its `prompt_tokens`).
pub fn reports_usage(tail: &[u8]) -> bool {
    tail.windows(USAGE.len()).any(|w| w == USAGE)
}

/// The last `cached_tokens` value in `tail`, if one is there whole.
pub fn cached_tokens(tail: &[u8]) -> Option<u64> {
    let at = tail.windows(KEY.len()).rposition(|w| w == KEY)?;
    let rest = &tail[at + KEY.len()..];
    let rest = trim_ws(rest).strip_prefix(b":")?;
    let rest = trim_ws(rest);
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits == rest.len() {
        // No number, or it may continue past the end of what we kept.
        return None;
    }
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

fn trim_ws(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|b| b.is_ascii_whitespace()).count();
    &s[n..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_cached_tokens_from_a_non_streaming_body() {
        let body = br#"{"choices":[],"usage":{"prompt_tokens":2100,"prompt_tokens_details":{"cached_tokens":2048},"completion_tokens":5}}"#;
        assert_eq!(cached_tokens(body), Some(2048));
    }

    #[test]
    fn reads_the_last_value_of_a_stream() {
        let body = b"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\": 16}}}\n\ndata: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\" : 32}}}\n\ndata: [DONE]\n\n";
        assert_eq!(cached_tokens(body), Some(32));
    }

    #[test]
    fn usage_without_details_is_told_apart_from_no_usage() {
        let miss = br#"{"choices":[],"usage":{"prompt_tokens":2100,"completion_tokens":5,"total_tokens":2105}}"#;
        assert!(reports_usage(miss));
        assert_eq!(cached_tokens(miss), None);
        assert!(!reports_usage(
            b"data: {\"choices\":[{\"delta\":{\"content\":\" tok\"}}]}\n\n"
        ));
    }

    #[test]
    fn missing_null_or_cut_values_give_none() {
        assert_eq!(cached_tokens(b"{\"usage\":{}}"), None);
        assert_eq!(cached_tokens(b"{\"cached_tokens\":null}"), None);
        assert_eq!(cached_tokens(b"{\"cached_tokens\":12"), None, "the number may continue");
        assert_eq!(cached_tokens(b""), None);
    }
}
