//! JSON answers drawn for a person at a terminal (`plyfs op`, `plyfs status`): a list of
//! objects becomes a table with a column per key, a field that holds a time becomes a local
//! time, and anything nested stays compact JSON in its cell. Scripts get the JSON itself.

use std::fmt::Write;

use serde_json::{Map, Value};

/// Columns shown first when present (what identifies a row), and last (long free text).
const FIRST: [&str; 8] = ["number", "id", "position", "layer", "op", "name", "branch", "mountpoint"];
const LAST: [&str; 6] = ["path", "dir", "rule", "args", "help", "error"];

/// `value` as text for a person.
pub fn draw(value: &Value) -> String {
    let mut out = String::new();
    match value {
        Value::Array(rows) if !rows.is_empty() && rows.iter().all(Value::is_object) => table(&mut out, "", rows),
        Value::Array(items) if items.is_empty() => out.push_str("(none)\n"),
        Value::Array(items) => items.iter().for_each(|v| _ = writeln!(out, "{}", cell("", v))),
        Value::Object(fields) => object(&mut out, fields),
        // A message, as the layer wrote it (its lines are not a table's cells), less what would
        // drive the terminal: a layer's answer may come from a script or another machine.
        Value::String(text) => _ = writeln!(out, "{}", text.chars().map(|c| if c == '\n' || c == '\t' { c.to_string() } else { visible(c) }).collect::<String>()),
        other => _ = writeln!(out, "{}", cell("", other)),
    }
    out
}

/// `key: value` lines, aligned; a field that is a list of objects is drawn as a table below
/// its key.
fn object(out: &mut String, fields: &Map<String, Value>) {
    let width = fields.keys().map(|k| k.chars().count()).max().unwrap_or(0) + 1;
    let mut tables = Vec::new();
    for (key, v) in fields {
        match v {
            Value::Array(rows) if !rows.is_empty() && rows.iter().all(Value::is_object) => tables.push((key, rows)),
            _ => _ = writeln!(out, "{:<width$} {}", format!("{}:", printable(key)), cell(key, v)),
        }
    }
    for (key, rows) in tables {
        let _ = writeln!(out, "{}:", printable(key));
        table(out, "  ", rows);
    }
}

/// `rows` as a table with exactly these columns, in this order.
pub fn draw_columns(rows: &[Value], columns: &[&str]) -> String {
    let mut out = String::new();
    columns_table(&mut out, "", rows, columns);
    out
}

fn table(out: &mut String, indent: &str, rows: &[Value]) {
    let mut keys: Vec<&str> = Vec::new();
    for row in rows.iter().filter_map(Value::as_object) {
        for k in row.keys() {
            if !keys.contains(&k.as_str()) {
                keys.push(k);
            }
        }
    }
    let rank = |k: &str| match (FIRST.iter().position(|f| *f == k), LAST.iter().position(|l| *l == k)) {
        (Some(i), _) => i,
        (None, Some(i)) => FIRST.len() + 1 + i,
        (None, None) => FIRST.len(),
    };
    keys.sort_by_key(|k| rank(k));
    columns_table(out, indent, rows, &keys);
}

fn columns_table(out: &mut String, indent: &str, rows: &[Value], keys: &[&str]) {
    let cells: Vec<Vec<String>> = rows.iter().map(|row| keys.iter().map(|k| cell(k, &row[*k])).collect()).collect();
    // Columns of numbers (counts, sizes) line up on the right, header included.
    let right: Vec<bool> = keys
        .iter()
        .map(|k| rows.iter().all(|r| (r[*k].is_number() && local(k, &r[*k]).is_none()) || r[*k].is_null()) && rows.iter().any(|r| r[*k].is_number()))
        .collect();
    let widths: Vec<usize> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| cells.iter().map(|r| r[i].chars().count()).chain([k.chars().count()]).max().unwrap_or(0))
        .collect();
    let line = |out: &mut String, texts: &[String]| {
        let mut l = indent.to_owned();
        for (i, text) in texts.iter().enumerate() {
            let w = widths[i];
            let _ = if right[i] { write!(l, "{text:>w$}  ") } else { write!(l, "{text:<w$}  ") };
        }
        let _ = writeln!(out, "{}", l.trim_end());
    };
    line(out, &keys.iter().map(|k| printable(k).to_uppercase()).collect::<Vec<_>>());
    for row in &cells {
        line(out, row);
    }
}

/// Whether a field's name says it holds a time: `saved`, `mtime`, `started_at`, `since`... but
/// not a duration (`uptime_s`) or a count (`records_since_x`).
fn is_time(key: &str) -> bool {
    matches!(key, "saved" | "modified" | "mtime" | "atime" | "ctime" | "time" | "since" | "when")
        || ["_at", "_time", "_since", "_mtime"].iter().any(|suffix| key.ends_with(suffix))
}

/// A time field's value as a local time: seconds since the epoch, from 1973 on (a count that
/// happens to end in `_at`, such as `looked_at`, stays a number).
fn local(key: &str, v: &Value) -> Option<String> {
    let secs = v.as_f64().filter(|s| is_time(key) && *s >= 1.0e8)?;
    Some(local_time(secs))
}

/// One value as a cell: a time field as a local time, a list of plain values joined, anything
/// nested as compact JSON, nothing as `-`.
fn cell(key: &str, v: &Value) -> String {
    if let Some(time) = local(key, v) {
        return time;
    }
    match v {
        Value::Null => "-".into(),
        Value::String(s) => printable(s),
        Value::Array(items) if items.iter().all(|i| !i.is_object() && !i.is_array()) => {
            if items.is_empty() {
                "-".into()
            } else {
                items.iter().map(|i| cell(key, i)).collect::<Vec<_>>().join(", ")
            }
        }
        other => other.to_string(),
    }
}

/// `text` with its control characters (and other invisible ones) written as escapes, so that an
/// answer cannot move the cursor, retitle or clear the terminal, or split a line.
pub fn printable(text: &str) -> String {
    text.chars().map(visible).collect()
}

fn visible(c: char) -> String {
    match c {
        '\'' | '"' => c.to_string(),
        c => c.escape_debug().to_string(),
    }
}

/// `2026-11-27 15:40:51`, in the local time zone, for seconds since the epoch.
pub fn local_time(epoch_secs: f64) -> String {
    match local_tm(epoch_secs.floor() as i64) {
        Some(tm) => format!("{:04}-{:02}-{:02} {:02}:{:02}:{:02}", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec),
        None => format!("{epoch_secs}"),
    }
}

/// `Nov 27 15:40:51` (the day padded with a space), local, as syslog lines carry it.
pub fn syslog_time(epoch_secs: i64) -> String {
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    match local_tm(epoch_secs) {
        Some(tm) => format!("{} {:>2} {:02}:{:02}:{:02}", MONTHS[tm.tm_mon.clamp(0, 11) as usize], tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec),
        None => "Jan  1 00:00:00".into(),
    }
}

fn local_tm(epoch_secs: i64) -> Option<libc::tm> {
    let t = epoch_secs as libc::time_t;
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: localtime_r writes only into `tm`.
    (!unsafe { libc::localtime_r(&t, &mut tm) }.is_null()).then_some(tm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn lists_of_objects_become_tables_with_local_times() {
        let versions = json!([
            {"number": 1, "saved": 1_795_793_451.25, "modified": 1_795_793_400.0, "size": 5, "path": ".versions/f/v1"},
            {"number": 12, "saved": 1_795_793_500.0, "modified": 1_795_793_499.0, "size": 12345, "path": ".versions/f/v12"},
        ]);
        let text = draw(&versions);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "NUMBER  MODIFIED             SAVED                 SIZE  PATH", "{text}");
        let (modified, saved) = (local_time(1_795_793_400.0), local_time(1_795_793_451.0));
        assert_eq!(lines[1], format!("     1  {modified}  {saved}      5  .versions/f/v1"), "{text}");
        assert_eq!(saved.len(), "2026-11-27 15:30:51".len());
        assert!(lines[2].starts_with("    12  "), "{text}");
        assert!(!is_time("uptime_s") && !is_time("records_since_checkpoint") && is_time("started_at"));
        assert_eq!(draw(&json!({"looked_at": 12})), "looked_at: 12\n", "a count, not a time");
    }

    #[test]
    fn objects_are_fields_with_nested_tables_and_compact_json() {
        let status = json!({
            "degraded": false, "reads_from": "a", "changes_in_flight": 0, "extra": {"k": 1},
            "branches": [{"name": "a", "state": "in-sync", "stale_paths": 0}, {"name": "b", "state": "failed", "stale_paths": 3}],
        });
        let text = draw(&status);
        assert!(text.contains("degraded:          false\n"), "{text}");
        assert!(text.contains("extra:             {\"k\":1}\n"), "{text}");
        assert!(text.contains("branches:\n  NAME  STALE_PATHS  STATE\n  a               0  in-sync\n  b               3  failed\n"), "{text}");
        assert_eq!(draw(&json!([])), "(none)\n");
        assert_eq!(draw(&json!({"repaired": ["x", "y\u{1b}"]})), "repaired: x, y\\u{1b}\n");
    }

    #[test]
    fn nothing_an_answer_holds_reaches_the_terminal_as_a_control_character() {
        let hostile = "\u{1b}]0;owned\u{7}\u{1b}[2J";
        for answer in [json!({hostile: 1}), json!([{hostile: 1}]), json!(format!("restored {hostile}\nline two")), json!({"k": {hostile: hostile}})] {
            let text = draw(&answer);
            assert!(!text.chars().any(|c| c.is_control() && c != '\n'), "{text:?}");
        }
        assert_eq!(draw(&json!("two\nlines\ttabbed")), "two\nlines\ttabbed\n", "a message keeps its lines");
    }
}
