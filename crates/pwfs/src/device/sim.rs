//! Simulated engine: pristine memory plus seeded faults, latency, and crash images.
//!
//! Every random choice comes from one seed. The engine keeps a log of the writes and
//! flushes it has seen since `start_recording`, so that a test can build the image a
//! crash would leave at any point of that log: everything before the last flush, plus
//! a random subset of the 512-byte sectors written after it (so a 4 KiB block can be
//! torn, and unflushed writes can land in any order).

use super::mem::{read_from, write_to};
use super::{validate, DevError, Device, Done, Op, OpKind, SECTOR};
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;

#[derive(Debug, Clone, Default)]
pub struct SimConfig {
    pub seed: u64,
    /// Probability that a read, write or flush fails with EIO.
    pub read_fail: f64,
    pub write_fail: f64,
    pub flush_fail: f64,
    /// Every write op after this many successful ones fails with EIO.
    pub fail_writes_after: Option<u64>,
    /// Added latency per op.
    pub latency: Duration,
}

#[derive(Debug, Clone)]
pub enum LogEntry {
    Write { offset: u64, data: Vec<u8> },
    Flush,
}

struct State {
    live: Vec<u8>,
    rng: SmallRng,
    log: Vec<LogEntry>,
    recording: bool,
    writes_ok: u64,
    stats: SimStats,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct SimStats {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub bytes_written: u64,
}

pub struct SimDevice {
    cfg: Mutex<SimConfig>,
    state: Mutex<State>,
    /// Flushes held back by a test (`hold_flushes`): whether they are held, and how
    /// many are waiting.
    gate: Mutex<(bool, usize)>,
    gate_cv: parking_lot::Condvar,
}

impl SimDevice {
    pub fn new(image: Vec<u8>, cfg: SimConfig) -> SimDevice {
        let rng = SmallRng::seed_from_u64(cfg.seed);
        SimDevice {
            cfg: Mutex::new(cfg),
            state: Mutex::new(State {
                live: image,
                rng,
                log: Vec::new(),
                recording: false,
                writes_ok: 0,
                stats: SimStats::default(),
            }),
            gate: Mutex::new((false, 0)),
            gate_cv: parking_lot::Condvar::new(),
        }
    }

    /// Hold every flush from now on until `release_flushes`: a test can keep a commit
    /// in the middle of its I/O.
    pub fn hold_flushes(&self) {
        self.gate.lock().0 = true;
    }

    pub fn release_flushes(&self) {
        self.gate.lock().0 = false;
        self.gate_cv.notify_all();
    }

    /// Flushes waiting at the gate now.
    pub fn flushes_held(&self) -> usize {
        self.gate.lock().1
    }

    /// Change the fault settings (the seed of the running generator is kept).
    pub fn set_config(&self, cfg: SimConfig) {
        *self.cfg.lock() = cfg;
    }

    /// Start (or restart) the write/flush log from the current image; returns that image.
    pub fn start_recording(&self) -> Vec<u8> {
        let mut s = self.state.lock();
        s.recording = true;
        s.log.clear();
        s.live.clone()
    }

    pub fn log(&self) -> Vec<LogEntry> {
        self.state.lock().log.clone()
    }

    pub fn log_len(&self) -> usize {
        self.state.lock().log.len()
    }

    pub fn snapshot(&self) -> Vec<u8> {
        self.state.lock().live.clone()
    }

    pub fn stats(&self) -> SimStats {
        self.state.lock().stats
    }
}

/// The image a crash after the first `upto` log entries could leave behind.
pub fn crash_image(base: &[u8], log: &[LogEntry], upto: usize, seed: u64) -> Vec<u8> {
    let mut image = base.to_vec();
    let log = &log[..upto.min(log.len())];
    let durable = log.iter().rposition(|e| matches!(e, LogEntry::Flush)).map_or(0, |i| i + 1);
    for e in &log[..durable] {
        if let LogEntry::Write { offset, data } = e {
            image[*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
        }
    }
    let mut rng = SmallRng::seed_from_u64(seed);
    for e in &log[durable..] {
        if let LogEntry::Write { offset, data } = e {
            // Whole write kept, whole write lost, or torn sector by sector.
            let mode = rng.gen_range(0..3);
            for (i, sector) in data.chunks(SECTOR as usize).enumerate() {
                let keep = match mode {
                    0 => true,
                    1 => false,
                    _ => rng.gen_bool(0.5),
                };
                if keep {
                    let at = *offset as usize + i * SECTOR as usize;
                    image[at..at + sector.len()].copy_from_slice(sector);
                }
            }
        }
    }
    image
}

impl Device for SimDevice {
    fn len(&self) -> u64 {
        self.state.lock().live.len() as u64
    }

    fn submit(&self, ops: Vec<Op>) -> Vec<Done> {
        let cfg = self.cfg.lock().clone();
        if !cfg.latency.is_zero() {
            std::thread::sleep(cfg.latency);
        }
        let mut s = self.state.lock();
        ops.into_iter()
            .map(|mut op| {
                let len = s.live.len() as u64;
                let result = validate(&op, len).and_then(|_| match op.kind {
                    OpKind::Read => {
                        s.stats.reads += 1;
                        if cfg.read_fail > 0.0 && s.rng.gen_bool(cfg.read_fail) {
                            return Err(DevError::Io(libc::EIO));
                        }
                        read_from(&s.live, &mut op);
                        Ok(())
                    }
                    OpKind::Write => {
                        s.stats.writes += 1;
                        let over = cfg.fail_writes_after.is_some_and(|n| s.writes_ok >= n);
                        if over || (cfg.write_fail > 0.0 && s.rng.gen_bool(cfg.write_fail)) {
                            return Err(DevError::Io(libc::EIO));
                        }
                        write_to(&mut s.live, &op);
                        s.writes_ok += 1;
                        s.stats.bytes_written += op.len();
                        if s.recording {
                            let mut data = Vec::with_capacity(op.len() as usize);
                            op.bufs.iter().for_each(|b| data.extend_from_slice(b));
                            s.log.push(LogEntry::Write { offset: op.offset, data });
                        }
                        Ok(())
                    }
                });
                Done { bufs: op.bufs, result }
            })
            .collect()
    }

    fn flush(&self) -> Result<(), DevError> {
        {
            let mut g = self.gate.lock();
            if g.0 {
                g.1 += 1;
                while g.0 {
                    self.gate_cv.wait(&mut g);
                }
                g.1 -= 1;
            }
        }
        let cfg = self.cfg.lock().clone();
        let mut s = self.state.lock();
        s.stats.flushes += 1;
        if cfg.flush_fail > 0.0 && s.rng.gen_bool(cfg.flush_fail) {
            return Err(DevError::Io(libc::EIO));
        }
        if s.recording {
            s.log.push(LogEntry::Flush);
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "sim"
    }
}
