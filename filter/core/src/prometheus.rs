//! A small reader for the Prometheus text exposition format (version 0.0.4), enough for the
//! vLLM families kvroute needs: `name{label="value",...} value [timestamp]` lines, `#`
//! comments, escaped label values (`\\`, `\"`, `\n`), `NaN` / `+Inf` / `-Inf` values.
//!
//! It is a pure function over text and reports what it could not read; callers decide which
//! series matter and skip the rest without parsing their labels.

use std::fmt;

/// Labels beyond this many on one series are refused (a "label bomb").
pub const MAX_LABELS: usize = 64;

#[derive(Clone, Debug, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, String)>,
    pub value: f64,
}

impl Sample<'_> {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| *k == key).map(|(_, v)| v.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LineError {
    pub line: usize,
    pub reason: &'static str,
}

impl fmt::Display for LineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.reason)
    }
}

/// The metric name a sample line starts with, or `None` for comments and blank lines.
pub fn sample_name(line: &str) -> Option<&str> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .unwrap_or(line.len());
    Some(&line[..end])
}

/// Parses one sample line (not a comment). `line_no` is 1-based, for messages.
pub fn parse_sample(line: &str, line_no: usize) -> Result<Sample<'_>, LineError> {
    let err = |reason| LineError { line: line_no, reason };
    let line = line.trim();
    let name = sample_name(line).ok_or(err("not a sample line"))?;
    if name.is_empty() {
        return Err(err("sample has no metric name"));
    }
    let mut rest = &line[name.len()..];
    let mut labels = Vec::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        rest = parse_labels(after_brace, &mut labels).map_err(err)?;
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = parse_value(fields.next().ok_or(err("sample has no value"))?).ok_or(err("value is not a number"))?;
    // An optional timestamp may follow; kvroute does not use it.
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().map_err(|_| err("timestamp is not an integer"))?;
    }
    if fields.next().is_some() {
        return Err(err("unexpected text after the timestamp"));
    }
    Ok(Sample { name, labels, value })
}

/// Parses `key="value",...}` and returns the text after the closing brace.
fn parse_labels<'a>(mut s: &'a str, labels: &mut Vec<(&'a str, String)>) -> Result<&'a str, &'static str> {
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Ok(rest);
        }
        if labels.len() >= MAX_LABELS {
            return Err("too many labels on one series");
        }
        let eq = s.find('=').ok_or("label without '='")?;
        let key = s[..eq].trim();
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err("label name is not valid");
        }
        let after = s[eq + 1..]
            .trim_start()
            .strip_prefix('"')
            .ok_or("label value is not quoted")?;
        let (value, rest) = unescape_until_quote(after)?;
        labels.push((key, value));
        s = rest.trim_start();
        s = s.strip_prefix(',').unwrap_or(s);
    }
}

fn unescape_until_quote(s: &str) -> Result<(String, &str), &'static str> {
    let mut out = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Ok((out, &s[i + 1..])),
            '\\' => match chars.next() {
                Some((_, 'n')) => out.push('\n'),
                Some((_, other)) => out.push(other),
                None => break,
            },
            c => out.push(c),
        }
    }
    Err("label value is not terminated")
}

fn parse_value(text: &str) -> Option<f64> {
    match text {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => text.parse::<f64>().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_values_and_timestamps_are_read() {
        let s = parse_sample(r#"vllm:x{a="1",b="two words"} 3.5e+00 1700000000000"#, 1).unwrap();
        assert_eq!(s.name, "vllm:x");
        assert_eq!(s.label("b"), Some("two words"));
        assert_eq!(s.value, 3.5);
    }

    #[test]
    fn escaped_label_values_are_unescaped() {
        let s = parse_sample(r#"m{a="q\"uote\\back\nline",} 1"#, 1).unwrap();
        assert_eq!(s.label("a"), Some("q\"uote\\back\nline"));
    }

    #[test]
    fn special_values_parse() {
        assert!(parse_sample("m NaN", 1).unwrap().value.is_nan());
        assert_eq!(parse_sample("m +Inf", 1).unwrap().value, f64::INFINITY);
        assert_eq!(parse_sample("m{} -Inf", 1).unwrap().value, f64::NEG_INFINITY);
    }

    #[test]
    fn broken_lines_are_errors_with_their_line_number() {
        for bad in [
            r#"m{a="1" 1"#,
            r#"m{a=1} 1"#,
            "m",
            "m abc",
            r#"m{a="x} 1"#,
            "m 1 2 3",
            "{a=\"1\"} 1",
        ] {
            let e = parse_sample(bad, 7).unwrap_err();
            assert_eq!(e.line, 7, "{bad}");
        }
    }

    #[test]
    fn a_label_bomb_is_refused() {
        let labels: Vec<String> = (0..MAX_LABELS + 1).map(|i| format!("l{i}=\"v\"")).collect();
        let line = format!("m{{{}}} 1", labels.join(","));
        assert_eq!(
            parse_sample(&line, 1).unwrap_err().reason,
            "too many labels on one series"
        );
    }

    #[test]
    fn comments_and_blank_lines_have_no_name() {
        assert_eq!(sample_name("# HELP m x"), None);
        assert_eq!(sample_name("   "), None);
        assert_eq!(sample_name("m{a=\"b\"} 1"), Some("m"));
    }
}
