//! A result table: rows of named values per column, with ratios, printed and as JSON.

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write;

#[derive(Debug, Clone)]
pub struct Row {
    pub name: String,
    pub unit: &'static str,
    /// Lower is better (latency) or higher is better (throughput).
    pub lower_is_better: bool,
    pub values: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    pub title: String,
    pub columns: Vec<String>,
    pub rows: Vec<Row>,
    /// (description, ratio, target, met)
    pub targets: Vec<(String, f64, String, bool)>,
    pub notes: Vec<String>,
    /// Columns every other column of a row is also shown relative to (`pwfs bench
    /// nbw`: Blocking and ext4), as tables after the main one and in the JSON.
    pub ratio_bases: Vec<String>,
    /// The device's own latencies at the start of the run (the disk changes from day
    /// to day: a target is judged against the kernel in the same run).
    pub device: Option<DeviceProbe>,
}

/// The device under the bench directory, measured directly: 4 KiB O_DIRECT random
/// reads and a 4 KiB O_DIRECT write followed by fdatasync (the flush), medians of a
/// few dozen, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceProbe {
    pub read_4k_us: f64,
    pub flush_us: f64,
}

impl DeviceProbe {
    pub fn measure(dir: &std::path::Path) -> DeviceProbe {
        Self::try_measure(dir).unwrap_or(DeviceProbe { read_4k_us: f64::NAN, flush_us: f64::NAN })
    }

    fn try_measure(dir: &std::path::Path) -> std::io::Result<DeviceProbe> {
        use std::os::unix::fs::OpenOptionsExt;
        use std::os::unix::io::AsRawFd;
        const SIZE: u64 = 16 << 20;
        let path = dir.join(".pwfs-device-probe");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)?;
        let mut buf = pwfs::device::AlignedBuf::new(1 << 20);
        buf.fill(0x3c);
        let fd = f.as_raw_fd();
        // Written through, so that reads reach the device rather than unwritten extents.
        for i in 0..SIZE >> 20 {
            // SAFETY: buf is valid for its length.
            if unsafe { libc::pwrite(fd, buf.as_ptr() as *const _, buf.len(), (i << 20) as i64) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        f.sync_all()?;
        let mut page = pwfs::device::AlignedBuf::new(4096);
        let (mut reads, mut flushes) = (Vec::new(), Vec::new());
        let mut x = 0x2545_f491u64;
        for i in 0..48u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let off = ((x >> 33) % (SIZE / 4096)) * 4096;
            let t = std::time::Instant::now();
            // SAFETY: page is valid for its length.
            if unsafe { libc::pread(fd, page.as_mut_ptr() as *mut _, 4096, off as i64) } != 4096 {
                return Err(std::io::Error::last_os_error());
            }
            reads.push(t.elapsed().as_secs_f64() * 1e6);
            let t = std::time::Instant::now();
            // SAFETY: page is valid for its length.
            if unsafe { libc::pwrite(fd, page.as_ptr() as *const _, 4096, ((i % 16) * 4096) as i64) } != 4096 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: plain syscall on our fd.
            unsafe { libc::fdatasync(fd) };
            flushes.push(t.elapsed().as_secs_f64() * 1e6);
        }
        drop(f);
        let _ = std::fs::remove_file(&path);
        Ok(DeviceProbe { read_4k_us: crate::median(reads), flush_us: crate::median(flushes) })
    }
}

impl Report {
    pub fn row(&mut self, name: &str, unit: &'static str, lower_is_better: bool, values: &[(&str, f64)]) {
        self.rows.push(Row {
            name: name.to_string(),
            unit,
            lower_is_better,
            values: values.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        });
    }

    /// Every cell holds a positive, finite figure (the smoke tests' check).
    pub fn check_filled(&self) -> Result<(), String> {
        for row in &self.rows {
            for (col, v) in &row.values {
                if !(v.is_finite() && *v > 0.0) {
                    return Err(format!("{} / {col} = {v}", row.name));
                }
            }
        }
        Ok(())
    }

    pub fn value(&self, row: &str, col: &str) -> f64 {
        self.rows.iter().find(|r| r.name == row).and_then(|r| r.values.get(col)).copied().unwrap_or(f64::NAN)
    }

    /// Record a target on the ratio `a/b` of two cells; none if the row was not run
    /// (`--only`).
    pub fn target(&mut self, what: &str, row: &str, a: &str, b: &str, at_most: Option<f64>, at_least: Option<f64>) {
        if !self.rows.iter().any(|r| r.name == row) {
            return;
        }
        let ratio = self.value(row, a) / self.value(row, b);
        let (met, text) = match (at_most, at_least) {
            (Some(m), _) => (ratio <= m, format!("<= {m}")),
            (_, Some(l)) => (ratio >= l, format!(">= {l}")),
            _ => (true, String::new()),
        };
        self.targets.push((format!("{what} ({row}: {a}/{b})"), ratio, text, met));
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{}", self.title);
        // Row names take 34 columns, or more where one is longer.
        let w = self.rows.iter().map(|r| r.name.len() + r.unit.len() + 4).max().unwrap_or(0).max(34);
        let _ = write!(s, "{:<w$}", "");
        for c in &self.columns {
            let _ = write!(s, " {c:>15}");
        }
        let pwfs_column = self.columns.iter().any(|c| c == "pwfs");
        if pwfs_column {
            let _ = write!(s, "{:>22}", "pwfs / best kernel");
        }
        let _ = writeln!(s);
        for r in &self.rows {
            let _ = write!(s, "{:<w$}", format!("{} ({})", r.name, r.unit));
            for c in &self.columns {
                match r.values.get(c) {
                    Some(v) if v.is_finite() => {
                        let _ = write!(s, " {v:>15.1}");
                    }
                    _ => {
                        let _ = write!(s, " {:>15}", "-");
                    }
                }
            }
            let kernel: Vec<f64> = r.values.iter().filter(|(k, _)| k.starts_with("ext4")).map(|(_, v)| *v).collect();
            let best = if r.lower_is_better {
                kernel.iter().copied().fold(f64::INFINITY, f64::min)
            } else {
                kernel.iter().copied().fold(0.0, f64::max)
            };
            match r.values.get("pwfs") {
                Some(p) if best.is_finite() && best > 0.0 => {
                    let _ = writeln!(s, "{:>21.2}x", p / best);
                }
                _ if pwfs_column => {
                    let _ = writeln!(s, "{:>22}", "-");
                }
                _ => {
                    let _ = writeln!(s);
                }
            }
        }
        for base in &self.ratio_bases {
            let _ = writeln!(s, "\nrelative to {base}:");
            let _ = write!(s, "{:<w$}", "");
            let others: Vec<&String> = self.columns.iter().filter(|c| *c != base).collect();
            for c in &others {
                let _ = write!(s, " {c:>15}");
            }
            let _ = writeln!(s);
            for r in &self.rows {
                let _ = write!(s, "{:<w$}", r.name);
                for c in &others {
                    let ratio =
                        r.values.get(*c).copied().unwrap_or(f64::NAN) / r.values.get(base).copied().unwrap_or(f64::NAN);
                    if ratio.is_finite() {
                        let _ = write!(s, " {:>14.2}x", ratio);
                    } else {
                        let _ = write!(s, " {:>15}", "-");
                    }
                }
                let _ = writeln!(s);
            }
        }
        if !self.targets.is_empty() {
            let _ = writeln!(s, "\ntargets:");
            for (what, ratio, target, met) in &self.targets {
                let _ = writeln!(s, "  [{}] {what}: {ratio:.2} (target {target})", if *met { "met" } else { "MISSED" });
            }
        }
        for n in &self.notes {
            let _ = writeln!(s, "note: {n}");
        }
        if let Some(d) = self.device {
            let _ = writeln!(s, "device: 4K read {:.1} us, write+flush {:.1} us", d.read_4k_us, d.flush_us);
        }
        s
    }

    /// Add the columns and rows of a record `json` wrote (a row of the same name is
    /// replaced). Figures only: notes, targets and the device are not merged.
    pub fn merge(&mut self, v: &Value) -> Result<(), String> {
        let columns = v["columns"].as_array().ok_or("no columns")?;
        for c in columns.iter().filter_map(Value::as_str) {
            if !self.columns.iter().any(|x| x == c) {
                self.columns.push(c.to_string());
            }
        }
        for row in v["rows"].as_array().ok_or("no rows")? {
            let name = row["name"].as_str().ok_or("a row without a name")?.to_string();
            // Units are few and fixed; a record's own is kept for as long as the process.
            let unit: &'static str = Box::leak(row["unit"].as_str().unwrap_or("").to_string().into_boxed_str());
            let values = row["values"]
                .as_object()
                .ok_or("a row without values")?
                .iter()
                .map(|(k, x)| (k.clone(), x.as_f64().unwrap_or(f64::NAN)))
                .collect();
            self.rows.retain(|r| r.name != name);
            self.rows.push(Row {
                name,
                unit,
                lower_is_better: row["lower_is_better"].as_bool().unwrap_or(true),
                values,
            });
        }
        Ok(())
    }

    pub fn json(&self) -> Value {
        json!({
            "title": self.title,
            "columns": self.columns,
            "rows": self.rows.iter().map(|r| json!({
                "name": r.name, "unit": r.unit, "lower_is_better": r.lower_is_better,
                "values": r.values.iter().map(|(k, v)| (k.clone(), if v.is_finite() { json!(v) } else { Value::Null })).collect::<serde_json::Map<_, _>>(),
                "ratios": self.ratio_bases.iter().filter_map(|b| {
                    let base = *r.values.get(b)?;
                    let rel = r.values.iter().filter(|(k, _)| *k != b).map(|(k, v)| {
                        let x = v / base;
                        (k.clone(), if x.is_finite() { json!(x) } else { Value::Null })
                    }).collect::<serde_json::Map<_, _>>();
                    Some((b.clone(), Value::Object(rel)))
                }).collect::<serde_json::Map<_, _>>(),
            })).collect::<Vec<_>>(),
            "targets": self.targets.iter().map(|(w, r, t, m)| json!({"what": w, "ratio": r, "target": t, "met": m})).collect::<Vec<_>>(),
            "notes": self.notes,
            "device": self.device.map(|d| json!({
                "read_4k_us": d.read_4k_us,
                "flush_us": d.flush_us,
                "note": "4 KiB O_DIRECT random read and 4 KiB O_DIRECT write + fdatasync on the bench directory's disk, medians of 48",
            })),
        })
    }
}
