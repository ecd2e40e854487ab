//! Charts of a peer comparison (the CSV `bench/peer/measure.py` writes): per readahead
//! setting one PNG with three panels — prefill tok/s, decode tok/s and disk MB read per
//! decoded token — with smoe-pipeline's bar beside llama.cpp's for every condition
//! (format, memory cap, prompt length).
//!
//! Usage: `peer_plots CSV OUT_PREFIX [FONT.ttf]`
//! writes `OUT_PREFIX-ra<KiB>.png`; the font (default DejaVu Sans) draws the text.

use std::collections::BTreeMap;
use std::process::ExitCode;

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
const ENGINES: [(&str, &str, RGBColor); 2] =
    [("ours", "smoe-pipeline", RGBColor(31, 119, 180)), ("llama", "llama.cpp", RGBColor(255, 127, 14))];
/// The panels: CSV column and title.
const METRICS: [(&str, &str); 3] = [
    ("prefill_tok_s", "prefill tok/s (higher is better)"),
    ("decode_tok_s", "decode tok/s (higher is better)"),
    ("bytes_per_token_mb", "disk MB read per decoded token (lower is better)"),
];

/// One measured run: its condition and its values by column.
struct Row {
    readahead: String,
    condition: String,
    engine: String,
    values: BTreeMap<String, f64>,
}

fn read_rows(path: &str) -> Result<Vec<Row>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().ok_or(format!("{path}: empty"))?.split(',').collect();
    let col =
        |name: &str| header.iter().position(|h| *h == name).ok_or(format!("{path}: no column `{name}`"));
    let (ra, fmt, cap, prompt, engine) =
        (col("readahead_kb")?, col("format")?, col("cap_mb")?, col("prompt")?, col("engine")?);
    // Files written before the decode-mode column hold greedy decodes only.
    let mode = col("decode").ok();
    let mut rows = Vec::new();
    for line in lines.filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() != header.len() {
            return Err(format!("{path}: row `{line}` has {} fields, the header {}", f.len(), header.len()));
        }
        let capped = f[cap].parse::<f64>().map(|c| c > 0.0).unwrap_or(false);
        let values =
            header.iter().zip(&f).filter_map(|(h, v)| Some((h.to_string(), v.parse().ok()?))).collect();
        rows.push(Row {
            readahead: f[ra].to_string(),
            condition: format!(
                "{} {} p{}{}",
                f[fmt],
                if capped { "cap" } else { "free" },
                f[prompt],
                mode.map_or("", |m| if f[m] == "random" { " rnd" } else { "" })
            ),
            engine: f[engine].to_string(),
            values,
        });
    }
    Ok(rows)
}

fn chart(rows: &[&Row], readahead: &str, path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let mut conditions: Vec<&str> = Vec::new();
    for r in rows {
        if !conditions.contains(&r.condition.as_str()) {
            conditions.push(&r.condition);
        }
    }
    let n = conditions.len();
    let root = BitMapBackend::new(path, ((160 * n as u32 + 200).max(900), 1200)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        &format!("smoe-pipeline vs llama.cpp, readahead {readahead} KiB, cold"),
        ("sans-serif", 26),
    )?;
    for (area, (metric, title)) in root.split_evenly((3, 1)).iter().zip(METRICS) {
        let value = |c: &str, e: &str| {
            rows.iter()
                .find(|r| r.condition == c && r.engine == e)
                .and_then(|r| r.values.get(metric).copied())
        };
        let top = conditions
            .iter()
            .flat_map(|c| ENGINES.iter().filter_map(move |(e, _, _)| value(c, e)))
            .fold(0.0f64, f64::max);
        let mut ch = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(70)
            .build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0f64..(top * 1.35).max(1e-3))?;
        ch.configure_mesh()
            .disable_x_mesh()
            .x_labels(n)
            .x_label_formatter(&|v| {
                let i = v.round();
                match conditions.get(i as usize) {
                    Some(c) if (v - i).abs() < 1e-3 && i >= 0.0 => c.to_string(),
                    _ => String::new(),
                }
            })
            .label_style(("sans-serif", 15))
            .draw()?;
        for (k, (engine, label, color)) in ENGINES.iter().enumerate() {
            let x0 = |i: usize| i as f64 - 0.4 + 0.4 * k as f64;
            let bars: Vec<(usize, f64)> =
                conditions.iter().enumerate().filter_map(|(i, c)| Some((i, value(c, engine)?))).collect();
            ch.draw_series(
                bars.iter().map(|&(i, v)| Rectangle::new([(x0(i), 0.0), (x0(i) + 0.38, v)], color.filled())),
            )?
            .label(*label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 12, y + 6)], color.filled()));
            ch.draw_series(bars.iter().map(|&(i, v)| {
                let text = if v >= 100.0 { format!("{v:.0}") } else { format!("{v:.2}") };
                EmptyElement::at((x0(i), v)) + Text::new(text, (2, -18), ("sans-serif", 14))
            }))?;
        }
        ch.configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE)
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

fn run(args: &[String]) -> Result<(), String> {
    let [csv, prefix, rest @ ..] = args else {
        return Err("usage: peer_plots CSV OUT_PREFIX [FONT.ttf]".into());
    };
    let font = rest.first().map(String::as_str).unwrap_or(DEFAULT_FONT);
    let bytes =
        std::fs::read(font).map_err(|e| format!("font {font}: {e} (give a .ttf as the third argument)"))?;
    register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
        .map_err(|_| format!("font {font}: not a TrueType font"))?;
    let rows = read_rows(csv)?;
    let mut by_ra: BTreeMap<&str, Vec<&Row>> = BTreeMap::new();
    for r in &rows {
        by_ra.entry(&r.readahead).or_default().push(r);
    }
    for (ra, rs) in by_ra {
        let path = format!("{prefix}-ra{ra}.png");
        chart(&rs, ra, &path).map_err(|e| format!("{path}: {e}"))?;
        println!("wrote {path}");
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("peer_plots: {e}");
            ExitCode::FAILURE
        }
    }
}
