//! `plyfs op MNT stats` on a terminal: each operation's latency histogram as a bar chart.

use std::fmt::Write;

use serde_json::Value;

/// The longest bar, in characters.
const WIDTH: f64 = 40.0;

fn duration(us: f64) -> String {
    if us >= 1_000_000.0 {
        format!("{:.3} s", us / 1_000_000.0)
    } else if us >= 1000.0 {
        format!("{:.1} ms", us / 1000.0)
    } else {
        format!("{us:.0} µs")
    }
}

/// A bar of `n` out of `max` (eighths of a block for the fraction, so small counts still show).
fn bar(n: u64, max: u64) -> String {
    const PARTS: [char; 8] = ['▏', '▎', '▍', '▌', '▋', '▊', '▉', '█'];
    if n == 0 || max == 0 {
        return String::new();
    }
    let eighths = ((n as f64 / max as f64) * WIDTH * 8.0).round().max(1.0) as usize;
    let mut s = "█".repeat(eighths / 8);
    if !eighths.is_multiple_of(8) {
        s.push(PARTS[eighths % 8 - 1]);
    }
    s
}

/// The statistics of a `trace` layer (`stats`), drawn: a header per operation (count, errors,
/// p50, p99, max), then one bar per latency bucket. The busiest operations first.
pub fn draw(stats: &Value) -> String {
    let mut out = String::new();
    let layer = stats["layer"].as_str().unwrap_or("trace");
    let uptime = stats["uptime_s"].as_f64().unwrap_or(0.0);
    let _ = writeln!(out, "{layer}: latency per operation over {uptime:.0} s (bucket: below this long)");
    let Some(ops) = stats["ops"].as_object() else { return out };
    let mut ops: Vec<(&String, &Value)> = ops.iter().collect();
    ops.sort_by_key(|(name, v)| (std::cmp::Reverse(v["count"].as_u64().unwrap_or(0)), (*name).clone()));
    for (name, v) in ops {
        let count = v["count"].as_u64().unwrap_or(0);
        let errors = v["errors"].as_u64().unwrap_or(0);
        let _ = writeln!(
            out,
            "\n{name}: {count} calls{}, mean {}, p50 < {}, p99 < {}, max {}",
            if errors > 0 { format!(" ({errors} failed)") } else { String::new() },
            duration(v["mean_us"].as_f64().unwrap_or(0.0)),
            duration(v["p50_us"].as_f64().unwrap_or(0.0)),
            duration(v["p99_us"].as_f64().unwrap_or(0.0)),
            duration(v["max_us"].as_f64().unwrap_or(0.0)),
        );
        let buckets: Vec<(u64, u64)> = v["histogram_us"]
            .as_array()
            .map(|a| a.iter().filter_map(|p| Some((p[0].as_u64()?, p[1].as_u64()?))).collect())
            .unwrap_or_default();
        let max = buckets.iter().map(|b| b.1).max().unwrap_or(0);
        for (below, n) in buckets {
            let _ = writeln!(out, "  < {:>8}  {:<w$} {n}", duration(below as f64), bar(n, max), w = WIDTH as usize + 1);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn histograms_draw_as_bars_busiest_first() {
        let stats = json!({
            "layer": "trace", "uptime_s": 3.0,
            "ops": {
                "read": {"count": 3, "errors": 0, "mean_us": 3.0, "p50_us": 4, "p99_us": 4, "max_us": 3.5, "histogram_us": [[2, 1], [4, 2]]},
                "lookup": {"count": 100, "errors": 2, "mean_us": 12.0, "p50_us": 8, "p99_us": 2048, "max_us": 1500.0,
                           "histogram_us": [[8, 80], [16, 0], [2048, 20]]},
            }
        });
        let text = draw(&stats);
        assert!(text.find("lookup: 100 calls (2 failed)").unwrap() < text.find("read: 3 calls").unwrap(), "{text}");
        assert!(text.contains(&format!("<     8 µs  {}", "█".repeat(40))), "{text}");
        assert!(text.contains("<   2.0 ms  ██████████ "), "{text}");
        assert!(text.contains("<    16 µs") && text.lines().any(|l| l.contains("16 µs") && l.trim_end().ends_with(" 0")), "{text}");
        assert_eq!(bar(1, 1000), "▏", "a count too small for a block still shows");
    }
}
