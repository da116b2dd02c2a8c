//! Where in a JSON document a parse error is: the path of keys and indices (`scrape.interval_ms`,
//! `endpoints[1]`) leading to the line and column serde_json reports. A small scan instead of
//! a path-tracking deserializer: that one doubled the configuration's share of the module.

enum Level {
    Object(Option<String>),
    Array(usize),
}

/// The path to the value or key that ends at `line`:`column` (1-based, as serde_json counts),
/// `None` at the top level or past the end.
pub(super) fn at(text: &str, line: usize, column: usize) -> Option<String> {
    let end = offset(text, line, column)?;
    let mut levels: Vec<Level> = Vec::new();
    let mut chars = text[..end].chars();
    // In an object, a string before its `:` is a key.
    let mut want_key = false;
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                let s = string(&mut chars);
                if let (true, Some(Level::Object(key))) = (want_key, levels.last_mut()) {
                    *key = Some(s);
                    want_key = false;
                }
            }
            '{' => {
                levels.push(Level::Object(None));
                want_key = true;
            }
            '[' => levels.push(Level::Array(0)),
            '}' | ']' => {
                levels.pop();
                want_key = false;
            }
            ',' => match levels.last_mut() {
                Some(Level::Array(i)) => *i += 1,
                Some(Level::Object(key)) => {
                    *key = None;
                    want_key = true;
                }
                None => {}
            },
            _ => {}
        }
    }
    let mut path = String::new();
    for level in &levels {
        match level {
            Level::Object(Some(key)) => {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(key);
            }
            Level::Object(None) => {}
            Level::Array(i) => path.push_str(&format!("[{i}]")),
        }
    }
    (!path.is_empty()).then_some(path)
}

/// The rest of a string whose opening quote was read; stops after its closing quote (or at
/// the end of what was scanned).
fn string(chars: &mut std::str::Chars) -> String {
    let mut s = String::new();
    while let Some(c) = chars.next() {
        match c {
            '"' => break,
            '\\' => {
                if let Some(escaped) = chars.next() {
                    s.push(escaped);
                }
            }
            _ => s.push(c),
        }
    }
    s
}

/// The byte offset just past `line`:`column`. serde_json counts a column in bytes (the
/// bytes read on that line), so a key with non-ASCII letters before the error moves it by
/// bytes too; an offset inside a character is moved back to its start.
fn offset(text: &str, line: usize, column: usize) -> Option<usize> {
    let start: usize = text
        .split_inclusive('\n')
        .take(line.checked_sub(1)?)
        .map(str::len)
        .sum();
    let mut end = start.checked_add(column)?.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Some(end)
}

#[cfg(test)]
mod tests {
    use super::at;

    fn path_of_error(json: &str) -> Option<String> {
        let e = serde_json::from_str::<serde_json::Value>(json).err();
        let (line, column) = e.map_or((1, json.chars().count()), |e| (e.line(), e.column()));
        at(json, line, column)
    }

    #[test]
    fn the_path_follows_keys_and_indices_to_the_position() {
        let json = "{\"a\": {\"b\": [1, {\"c\": 2, \"d\": 3}]}}";
        let pos = json.find("3").unwrap() + 1;
        assert_eq!(at(json, 1, pos).as_deref(), Some("a.b[1].d"));
        let pos = json.find("1,").unwrap() + 1;
        assert_eq!(at(json, 1, pos).as_deref(), Some("a.b[0]"));
        assert_eq!(at("{}", 1, 1), None, "the top level has no path");
    }

    #[test]
    fn a_column_counts_bytes_as_serde_json_does() {
        // "é" and "ü" are two bytes each: a type error after the string value of "ü" ends
        // one byte before the `}`, which a count of characters would pass.
        let json = "{\"é\": 1, \"ü\": {\"z\": \"x\"}}";
        let column = json.find("\"x\"").unwrap() + 3;
        assert_eq!(at(json, 1, column).as_deref(), Some("ü.z"));
        assert_eq!(at(json, 1, column + 1).as_deref(), Some("ü"), "past the closing brace");
    }

    #[test]
    fn keys_with_escapes_and_several_lines_are_read() {
        let json = "{\n  \"x\\\"y\": {\n    \"z\": tru\n  }\n}";
        assert_eq!(path_of_error(json).as_deref(), Some("x\"y.z"));
    }
}
