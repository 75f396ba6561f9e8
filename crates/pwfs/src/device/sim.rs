//! Simulated engine: pristine memory plus seeded faults, latency, and crash images.
//!
//! Every random choice comes from one seed. The engine keeps a log of the writes and
//! flushes it has seen since `start_recording`, so that a test can build the image a
//! crash would leave at any point of that log: everything before the last flush, plus
//! a random subset of the 512-byte sectors written after it (so a 4 KiB block can be
//! torn, and unflushed writes can land in any order). A FUA write is durable on its
//! own: it is logged as [`LogEntry::WriteFua`], which every crash image keeps.
//!
//! `start` carries out the batch's reads and writes at once, in op order, and its
//! flushes too unless a test holds them (`hold_flushes`): a held flush, and the ops after
//! it in its batch, run when the flushes are released and someone polls or waits for
//! the handle (dropping the handle waits for the release too, except while unwinding
//! from a panic, when they never run, as if the process had died). The handle completes
//! `latency` after `start`.

use super::{validate, Completion, DevError, Device, Done, MemoryMedium, Op, OpKind, Pending, SECTOR};
use parking_lot::{Condvar, Mutex};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Default)]
pub struct SimConfig {
    pub seed: u64,
    /// Probability that a read, write or flush fails with EIO.
    pub read_fail: f64,
    pub write_fail: f64,
    pub flush_fail: f64,
    /// Every write op after this many successful ones fails with EIO.
    pub fail_writes_after: Option<u64>,
    /// Added latency per batch: a handle completes this long after `start`.
    pub latency: Duration,
}

#[derive(Debug, Clone)]
pub enum LogEntry {
    Write {
        offset: u64,
        data: Vec<u8>,
    },
    /// A write that was durable when it completed (FUA): in every crash image after it.
    WriteFua {
        offset: u64,
        data: Vec<u8>,
    },
    Flush,
}

/// What the device saw, in order (recorded with the log): the ops as they were
/// carried out, and when their batch's results were handed to the caller. A write
/// is known complete to the caller only from its batch's `Completed` on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Write { batch: u64, offset: u64, len: u64, fua: bool },
    Flush { batch: u64 },
    Completed { batch: u64 },
}

struct State {
    rng: SmallRng,
    log: Vec<LogEntry>,
    events: Vec<Event>,
    next_batch: u64,
    recording: bool,
    writes_ok: u64,
    stats: SimStats,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct SimStats {
    pub reads: u64,
    /// Writes, FUA writes included.
    pub writes: u64,
    pub fua_writes: u64,
    pub flushes: u64,
    pub bytes_written: u64,
}

pub struct SimDevice {
    shared: Arc<Shared>,
}

struct Shared {
    cfg: Mutex<SimConfig>,
    /// Lock order: `state`, then the medium's own lock.
    state: Mutex<State>,
    medium: MemoryMedium,
    /// Flushes held back by a test (`hold_flushes`): whether they are held, and how
    /// many are waiting (flushes of handles not yet finished included).
    gate: Mutex<(bool, usize)>,
    gate_cv: Condvar,
}

impl SimDevice {
    pub fn new(image: Vec<u8>, cfg: SimConfig) -> SimDevice {
        let rng = SmallRng::seed_from_u64(cfg.seed);
        SimDevice {
            shared: Arc::new(Shared {
                cfg: Mutex::new(cfg),
                state: Mutex::new(State {
                    rng,
                    log: Vec::new(),
                    events: Vec::new(),
                    next_batch: 0,
                    recording: false,
                    writes_ok: 0,
                    stats: SimStats::default(),
                }),
                medium: MemoryMedium::new(image),
                gate: Mutex::new((false, 0)),
                gate_cv: Condvar::new(),
            }),
        }
    }

    /// Hold every flush (and FUA write) from now on until `release_flushes`: a test can keep a commit
    /// in the middle of its I/O.
    pub fn hold_flushes(&self) {
        self.shared.gate.lock().0 = true;
    }

    pub fn release_flushes(&self) {
        self.shared.gate.lock().0 = false;
        self.shared.gate_cv.notify_all();
    }

    /// Flushes waiting at the gate now.
    pub fn flushes_held(&self) -> usize {
        self.shared.gate.lock().1
    }

    /// Change the fault settings (the seed of the running generator is kept).
    pub fn set_config(&self, cfg: SimConfig) {
        *self.shared.cfg.lock() = cfg;
    }

    /// Start (or restart) the write/flush log from the current image; returns that image.
    pub fn start_recording(&self) -> Vec<u8> {
        let mut s = self.shared.state.lock();
        s.recording = true;
        s.log.clear();
        s.events.clear();
        self.shared.medium.snapshot()
    }

    /// The order of writes, flushes and completions since `start_recording`.
    pub fn events(&self) -> Vec<Event> {
        self.shared.state.lock().events.clone()
    }

    pub fn log(&self) -> Vec<LogEntry> {
        self.shared.state.lock().log.clone()
    }

    pub fn log_len(&self) -> usize {
        self.shared.state.lock().log.len()
    }

    pub fn snapshot(&self) -> Vec<u8> {
        let _s = self.shared.state.lock();
        self.shared.medium.snapshot()
    }

    pub fn stats(&self) -> SimStats {
        self.shared.state.lock().stats
    }
}

/// The image a crash after the first `upto` log entries could leave behind.
pub fn crash_image(base: &[u8], log: &[LogEntry], upto: usize, seed: u64) -> Vec<u8> {
    let mut image = base.to_vec();
    let log = &log[..upto.min(log.len())];
    let durable = log.iter().rposition(|e| matches!(e, LogEntry::Flush)).map_or(0, |i| i + 1);
    for e in &log[..durable] {
        if let LogEntry::Write { offset, data } | LogEntry::WriteFua { offset, data } = e {
            image[*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
        }
    }
    let mut rng = SmallRng::seed_from_u64(seed);
    for e in &log[durable..] {
        match e {
            LogEntry::Write { offset, data } => {
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
            // Durable when it completed; a later unflushed write over it may land or not.
            LogEntry::WriteFua { offset, data } => {
                image[*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
            }
            LogEntry::Flush => unreachable!("after the last flush"),
        }
    }
    image
}

impl Shared {
    /// Carry out one op on the medium, with the faults `cfg` asks for.
    fn run(&self, cfg: &SimConfig, batch: u64, op: &mut Op) -> Result<(), DevError> {
        let mut s = self.state.lock();
        validate(op, self.medium.len())?;
        match op.kind {
            OpKind::Read => {
                s.stats.reads += 1;
                if cfg.read_fail > 0.0 && s.rng.gen_bool(cfg.read_fail) {
                    return Err(DevError::Io(libc::EIO));
                }
                self.medium.load(op);
            }
            OpKind::Write | OpKind::WriteFua => {
                s.stats.writes += 1;
                let fua = op.kind == OpKind::WriteFua;
                s.stats.fua_writes += fua as u64;
                let over = cfg.fail_writes_after.is_some_and(|n| s.writes_ok >= n);
                if over || (cfg.write_fail > 0.0 && s.rng.gen_bool(cfg.write_fail)) {
                    return Err(DevError::Io(libc::EIO));
                }
                self.medium.store(op);
                if fua {
                    self.medium.persist(op.offset, op.len());
                }
                s.writes_ok += 1;
                s.stats.bytes_written += op.len();
                if s.recording {
                    s.events.push(Event::Write { batch, offset: op.offset, len: op.len(), fua });
                    let mut data = Vec::with_capacity(op.len() as usize);
                    op.bufs.iter().for_each(|b| data.extend_from_slice(b));
                    let offset = op.offset;
                    s.log.push(if fua {
                        LogEntry::WriteFua { offset, data }
                    } else {
                        LogEntry::Write { offset, data }
                    });
                }
            }
            OpKind::Flush => {
                s.stats.flushes += 1;
                if cfg.flush_fail > 0.0 && s.rng.gen_bool(cfg.flush_fail) {
                    return Err(DevError::Io(libc::EIO));
                }
                self.medium.persist(0, self.medium.len());
                if s.recording {
                    s.log.push(LogEntry::Flush);
                    s.events.push(Event::Flush { batch });
                }
            }
        }
        Ok(())
    }
}

/// A started batch: ops before `next` are carried out, the rest wait for a held flush.
struct SimBatch {
    dev: Arc<Shared>,
    id: u64,
    cfg: SimConfig,
    ops: Vec<Op>,
    results: Vec<Option<Result<(), DevError>>>,
    next: usize,
    ready_at: Instant,
    /// The flush at `next` is counted as waiting at the gate.
    at_gate: bool,
    taken: bool,
}

impl SimBatch {
    /// Carry out the ops from `next` on; a held flush stops a non-blocking call there
    /// and waits for the release otherwise. True once every op is carried out.
    fn advance(&mut self, block: bool) -> bool {
        while self.next < self.ops.len() {
            let op = &mut self.ops[self.next];
            // A FUA write includes a flush: it is held back with them.
            if (op.kind == OpKind::Flush && op.bufs.is_empty()) || op.kind == OpKind::WriteFua {
                let mut g = self.dev.gate.lock();
                if g.0 && !self.at_gate {
                    g.1 += 1;
                    self.at_gate = true;
                }
                if g.0 && !block {
                    return false;
                }
                while g.0 {
                    self.dev.gate_cv.wait(&mut g);
                }
                if self.at_gate {
                    g.1 -= 1;
                    self.at_gate = false;
                }
            }
            self.results[self.next] = Some(self.dev.run(&self.cfg, self.id, op));
            self.next += 1;
        }
        true
    }
}

impl Completion for SimBatch {
    fn poll(&mut self) -> bool {
        self.advance(false) && Instant::now() >= self.ready_at
    }

    fn wait(&mut self) -> Vec<Done> {
        self.advance(true);
        let now = Instant::now();
        if now < self.ready_at {
            std::thread::sleep(self.ready_at - now);
        }
        self.taken = true;
        {
            let mut s = self.dev.state.lock();
            if s.recording {
                s.events.push(Event::Completed { batch: self.id });
            }
        }
        std::mem::take(&mut self.ops)
            .into_iter()
            .zip(std::mem::take(&mut self.results))
            .map(|(op, r)| Done { bufs: op.bufs, result: r.expect("every op carried out") })
            .collect()
    }
}

impl Drop for SimBatch {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        if std::thread::panicking() {
            // Unwinding: a test that holds flushes may never release them. The ops not
            // yet carried out never reach the medium, as if the process had died.
            if self.at_gate {
                self.dev.gate.lock().1 -= 1;
            }
            return;
        }
        self.advance(true);
    }
}

impl Device for SimDevice {
    fn len(&self) -> u64 {
        self.shared.medium.len()
    }

    fn start(&self, ops: Vec<Op>) -> Pending {
        let cfg = self.shared.cfg.lock().clone();
        let results = ops.iter().map(|_| None).collect();
        let id = {
            let mut s = self.shared.state.lock();
            s.next_batch += 1;
            s.next_batch
        };
        let mut batch = SimBatch {
            dev: self.shared.clone(),
            id,
            ready_at: Instant::now() + cfg.latency,
            cfg,
            ops,
            results,
            next: 0,
            at_gate: false,
            taken: false,
        };
        if batch.advance(false) && batch.cfg.latency.is_zero() {
            return Pending::ready(batch.wait());
        }
        Pending::new(Box::new(batch))
    }

    fn name(&self) -> &'static str {
        "sim"
    }
}
