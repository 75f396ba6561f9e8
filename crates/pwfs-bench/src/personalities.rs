//! Filebench-like workloads ("personalities") over plain `std::fs`, so that the same
//! code runs on a pwfs FUSE mount and on ext4 and the two can be compared.
//!
//! These are modelled on Filebench's `fileserver.f`, `webproxy.f`, `varmail.f` and
//! `randomrw.f`; they are *not* Filebench itself (no gamma-distributed sizes, no
//! shared-memory process model, no per-flowop latencies), only the same sequence of
//! file system calls, run by threads for a fixed time:
//!
//! - [`Personality::FileServer`] (an NFS-like file server): 50 threads, 10,000 files of
//!   128 KiB spread over 20 subdirectories. Each thread loops: create a new file and
//!   write it whole (writes of at most 1 MiB), close; open a random file, append
//!   16 KiB, close; open a random file, read it whole, close; delete a random file;
//!   stat a random file.
//! - [`Personality::WebProxy`] (a caching web proxy): 100 threads, 10,000 files of
//!   16 KiB in one directory. Each thread loops: delete a random file; create a file
//!   and write it whole (16 KiB), close; five times open a random file, read it whole,
//!   close; append 16 KiB to a log file shared by all threads (each thread holds its
//!   own `O_APPEND` descriptor to it, opened before the timed part).
//! - [`Personality::VarMail`] (a mail server, `/var/mail`): 16 threads, 1,000 files
//!   of 16 KiB in one directory. Each thread loops: delete a random file; create a
//!   file, append 16 KiB, fsync, close; open a random file, read it whole, append
//!   16 KiB, fsync, close; open a random file, read it whole, close.
//! - [`Personality::RandomRw`] (a database-like random read/write mix): one large
//!   file (1 GiB), two threads, each with the file open from before the timed part:
//!   one does random 8 KiB reads, the other random 8 KiB writes, at 8 KiB-aligned
//!   offsets. With more threads, even-numbered ones read and odd-numbered ones write.
//!
//! Operations are counted as Filebench counts flowops, except that closes are not
//! counted: each open, create, delete, stat, fsync, append, whole-file read and
//! whole-file write counts one (a whole-file read or write is one operation however
//! many system calls it takes, like Filebench's `readwholefile`/`writewholefile`).
//! Threads pick files from a shared set of live file names; a file picked by one
//! thread can be deleted by another before it is opened or stat'ed, and then that
//! operation is skipped (not counted, not an error). New files get fresh names from
//! a counter; a deleted name is never reused.
//!
//! [`prepare`] builds the file set (not timed, and not synced: callers that want a
//! cold or clean start sync or drop caches themselves), [`run`] runs the timed part
//! and may be repeated (it reads the current file set from the directory), and
//! [`cleanup`] removes everything.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
/// Size of every append (Filebench's `meanappendsize`, here fixed).
const APPEND_BYTES: usize = 16 * 1024;
/// Largest single read or write of a whole-file read or write (Filebench's `iosize`).
const IO_CHUNK: u64 = MIB;
/// Size and alignment of RandomRw's reads and writes.
const RANDOM_IO: u64 = 8 * KIB;
/// Subdirectories of FileServer's file set.
const FILESERVER_DIRS: u64 = 20;
/// Whole-file reads per WebProxy loop.
const WEBPROXY_READS: usize = 5;
/// WebProxy's shared log file, next to the file set.
const LOG_NAME: &str = "log";
/// RandomRw's one file.
const LARGE_NAME: &str = "largefile";
const SEED: u64 = 42;

/// One of the Filebench-like workloads; see the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Personality {
    FileServer,
    WebProxy,
    VarMail,
    RandomRw,
}

/// How big and how long a personality runs.
#[derive(Clone, Debug)]
pub struct Load {
    /// Worker threads of the timed part.
    pub threads: usize,
    /// Files in the file set (RandomRw: 1).
    pub files: usize,
    /// Size of each file (RandomRw: of the one large file), and of each whole-file
    /// write of FileServer and WebProxy.
    pub file_bytes: u64,
    /// Length of the timed part.
    pub duration: Duration,
    /// Seeds every thread's random number generator (and the files' contents).
    pub seed: u64,
}

impl Personality {
    /// Every personality, in the order the bench runs them.
    pub const ALL: [Personality; 4] =
        [Personality::FileServer, Personality::WebProxy, Personality::VarMail, Personality::RandomRw];

    /// The name Filebench gives the personality; also the subdirectory it works in.
    pub fn name(self) -> &'static str {
        match self {
            Personality::FileServer => "fileserver",
            Personality::WebProxy => "webproxy",
            Personality::VarMail => "varmail",
            Personality::RandomRw => "randomrw",
        }
    }

    /// Full size: Filebench's thread counts, 10,000 files (VarMail 1,000; RandomRw one
    /// 1 GiB file), 10 seconds.
    pub fn full(self) -> Load {
        let (threads, files, file_bytes) = match self {
            Personality::FileServer => (50, 10_000, 128 * KIB),
            Personality::WebProxy => (100, 10_000, 16 * KIB),
            Personality::VarMail => (16, 1_000, 16 * KIB),
            Personality::RandomRw => (2, 1, 1024 * MIB),
        };
        Load { threads, files, file_bytes, duration: Duration::from_secs(10), seed: SEED }
    }

    /// About a tenth of the files (RandomRw: 256 MiB), same threads, 2 seconds.
    pub fn quick(self) -> Load {
        let full = self.full();
        let (files, file_bytes) = match self {
            Personality::FileServer | Personality::WebProxy => (1_000, full.file_bytes),
            Personality::VarMail => (200, full.file_bytes),
            Personality::RandomRw => (1, 256 * MIB),
        };
        Load { files, file_bytes, duration: Duration::from_secs(2), ..full }
    }

    /// Tiny, for tests: 2 threads, 20 files of 16 KiB (RandomRw: one 8 MiB file),
    /// 200 ms.
    pub fn smoke(self) -> Load {
        let (files, file_bytes) = match self {
            Personality::RandomRw => (1, 8 * MIB),
            _ => (20, 16 * KIB),
        };
        Load { threads: 2, files, file_bytes, duration: Duration::from_millis(200), seed: SEED }
    }

    /// Subdirectories of the file set (0: the files sit in the personality's directory).
    fn dirs(self) -> u64 {
        match self {
            Personality::FileServer => FILESERVER_DIRS,
            _ => 0,
        }
    }
}

/// Creates the file set in `dir/<name>` (removed first if it exists). Not timed.
pub fn prepare(p: Personality, dir: &Path, load: &Load) -> Result<(), String> {
    let root = dir.join(p.name());
    match fs::remove_dir_all(&root) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(ctx("prepare: remove old", &root, e)),
    }
    fs::create_dir_all(&root).map_err(|e| ctx("prepare: mkdir", &root, e))?;
    let mut rng = Rng::new(load.seed, u64::MAX);
    let mut buf = vec![0u8; load.file_bytes.min(IO_CHUNK) as usize];
    rng.fill(&mut buf);
    if p == Personality::RandomRw {
        if load.file_bytes < RANDOM_IO {
            return Err(format!(
                "prepare randomrw: file_bytes {} is below one {RANDOM_IO}-byte block",
                load.file_bytes
            ));
        }
        let path = root.join(LARGE_NAME);
        let mut f = create_new(&path).map_err(|e| ctx("prepare: create", &path, e))?;
        write_whole(&mut f, &buf, load.file_bytes).map_err(|e| ctx("prepare: write", &path, e))?;
        return Ok(());
    }
    let set = FileSet { root: root.clone(), dirs: p.dirs(), live: Mutex::new(Vec::new()), next_id: AtomicU64::new(0) };
    for d in 0..set.dirs {
        let path = set.dir_path(d);
        fs::create_dir(&path).map_err(|e| ctx("prepare: mkdir", &path, e))?;
    }
    for id in 0..load.files as u64 {
        let path = set.path(id);
        let mut f = create_new(&path).map_err(|e| ctx("prepare: create", &path, e))?;
        write_whole(&mut f, &buf, load.file_bytes).map_err(|e| ctx("prepare: write", &path, e))?;
    }
    if p == Personality::WebProxy {
        let path = root.join(LOG_NAME);
        create_new(&path).map_err(|e| ctx("prepare: create", &path, e))?;
    }
    Ok(())
}

/// Runs the timed part on what [`prepare`] made (or an earlier `run` left) and
/// returns operations per second, all threads together (see the module documentation
/// for what counts as an operation).
pub fn run(p: Personality, dir: &Path, load: &Load) -> Result<f64, String> {
    if load.threads == 0 {
        return Err(format!("run {}: no threads", p.name()));
    }
    let root = dir.join(p.name());
    if !root.is_dir() {
        return Err(format!("run {}: {} is not a directory (prepare first)", p.name(), root.display()));
    }
    let set = match p {
        Personality::RandomRw => None,
        _ => Some(FileSet::scan(&root, p.dirs())?),
    };
    let stop = AtomicBool::new(false);
    let gate = Gate::default();
    let (set, stop, gate, root) = (&set, &stop, &gate, &root);

    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(load.threads);
        let mut spawn_err = None;
        for t in 0..load.threads {
            let worker = move || -> Result<u64, String> {
                let mut rng = Rng::new(load.seed, t as u64);
                let result = match set {
                    Some(set) => {
                        let w = Worker::new(set, rng, load.file_bytes);
                        file_set_thread(p, w, root, stop, gate)
                    }
                    None => random_rw_thread(t % 2 == 1, &mut rng, &root.join(LARGE_NAME), stop, gate),
                };
                if result.is_err() {
                    stop.store(true, Ordering::Release);
                }
                result
            };
            match std::thread::Builder::new().name(format!("{}-{t}", p.name())).spawn_scoped(s, worker) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    spawn_err = Some(format!("run {}: spawn thread {t}: {e}", p.name()));
                    stop.store(true, Ordering::Release);
                    break;
                }
            }
        }
        if spawn_err.is_none() {
            gate.wait_ready(handles.len());
        }
        gate.open();
        let start = Instant::now();
        let deadline = start + load.duration;
        while !stop.load(Ordering::Acquire) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            std::thread::sleep((deadline - now).min(Duration::from_millis(5)));
        }
        stop.store(true, Ordering::Release);
        let mut total = 0u64;
        let mut first_err = spawn_err;
        for h in handles {
            match h.join() {
                Ok(Ok(ops)) => total += ops,
                Ok(Err(e)) => {
                    first_err.get_or_insert(format!("run {}: {e}", p.name()));
                }
                Err(_) => {
                    first_err.get_or_insert(format!("run {}: a thread panicked", p.name()));
                }
            }
        }
        let elapsed = start.elapsed().as_secs_f64();
        match first_err {
            Some(e) => Err(e),
            None => Ok(total as f64 / elapsed.max(1e-9)),
        }
    })
}

/// Removes what [`prepare`] (and [`run`]) made; nothing to remove is not an error.
pub fn cleanup(p: Personality, dir: &Path) -> Result<(), String> {
    let root = dir.join(p.name());
    match fs::remove_dir_all(&root) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(ctx("cleanup: remove", &root, e)),
    }
}

/// One thread of FileServer, WebProxy or VarMail: setup, then the loop until `stop`.
fn file_set_thread(p: Personality, mut w: Worker, root: &Path, stop: &AtomicBool, gate: &Gate) -> Result<u64, String> {
    let log_path = root.join(LOG_NAME);
    let log = match p {
        Personality::WebProxy => {
            Some(OpenOptions::new().append(true).open(&log_path).map_err(|e| ctx("open log", &log_path, e)))
        }
        _ => None,
    };
    gate.arrive_and_wait();
    let mut log = log.transpose()?;
    while !stop.load(Ordering::Relaxed) {
        match (p, log.as_mut()) {
            (Personality::FileServer, _) => w.fileserver_loop()?,
            (Personality::WebProxy, Some(log)) => w.webproxy_loop(log, &log_path)?,
            (Personality::VarMail, _) => w.varmail_loop()?,
            _ => return Err(format!("{p:?} has no file-set loop")),
        }
    }
    Ok(w.ops)
}

/// One thread of RandomRw: random 8 KiB reads (or writes) of the large file.
fn random_rw_thread(writer: bool, rng: &mut Rng, path: &Path, stop: &AtomicBool, gate: &Gate) -> Result<u64, String> {
    let file = OpenOptions::new()
        .read(!writer)
        .write(writer)
        .open(path)
        .and_then(|f| Ok((f.metadata()?.len(), f)))
        .map_err(|e| ctx("open", path, e));
    gate.arrive_and_wait();
    let (bytes, file) = file?;
    let blocks = bytes / RANDOM_IO;
    if blocks == 0 {
        return Err(format!("{}: {bytes} bytes, below one {RANDOM_IO}-byte block", path.display()));
    }
    let mut buf = vec![0u8; RANDOM_IO as usize];
    rng.fill(&mut buf);
    let mut ops = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let off = rng.below(blocks) * RANDOM_IO;
        if writer {
            file.write_all_at(&buf, off).map_err(|e| ctx(&format!("write at {off}"), path, e))?;
        } else {
            file.read_exact_at(&mut buf, off).map_err(|e| ctx(&format!("read at {off}"), path, e))?;
        }
        ops += 1;
    }
    Ok(ops)
}

/// The live files of a file set, shared by all threads: names are `f<id>`, in
/// subdirectory `d<id % dirs>` if there are subdirectories.
struct FileSet {
    root: PathBuf,
    dirs: u64,
    live: Mutex<Vec<u64>>,
    next_id: AtomicU64,
}

impl FileSet {
    /// Reads the live files from the directory, so that `run` can be repeated.
    fn scan(root: &Path, dirs: u64) -> Result<FileSet, String> {
        let set = FileSet { root: root.to_path_buf(), dirs, live: Mutex::new(Vec::new()), next_id: AtomicU64::new(0) };
        let mut ids = Vec::new();
        let scan_dirs: Vec<PathBuf> =
            if dirs == 0 { vec![root.to_path_buf()] } else { (0..dirs).map(|d| set.dir_path(d)).collect() };
        for d in scan_dirs {
            let entries = fs::read_dir(&d).map_err(|e| ctx("scan: readdir", &d, e))?;
            for entry in entries {
                let entry = entry.map_err(|e| ctx("scan: readdir", &d, e))?;
                let name = entry.file_name();
                if let Some(id) = name.to_str().and_then(|n| n.strip_prefix('f')).and_then(|n| n.parse::<u64>().ok()) {
                    ids.push(id);
                }
            }
        }
        ids.sort_unstable();
        set.next_id.store(ids.last().map_or(0, |&id| id + 1), Ordering::Relaxed);
        *set.lock() = ids;
        Ok(set)
    }

    fn dir_path(&self, d: u64) -> PathBuf {
        self.root.join(format!("d{d:02}"))
    }

    fn path(&self, id: u64) -> PathBuf {
        let name = format!("f{id:08}");
        if self.dirs == 0 {
            self.root.join(name)
        } else {
            self.dir_path(id % self.dirs).join(name)
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<u64>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A random live file (which may be deleted before the caller uses it).
    fn pick(&self, rng: &mut Rng) -> Option<u64> {
        let live = self.lock();
        if live.is_empty() {
            return None;
        }
        Some(live[rng.below(live.len() as u64) as usize])
    }

    /// Takes a random live file out of the set, for deletion.
    fn take(&self, rng: &mut Rng) -> Option<u64> {
        let mut live = self.lock();
        if live.is_empty() {
            return None;
        }
        let i = rng.below(live.len() as u64) as usize;
        Some(live.swap_remove(i))
    }

    fn add(&self, id: u64) {
        self.lock().push(id);
    }

    fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// One thread's state: its random numbers, buffers and operation count.
struct Worker<'a> {
    set: &'a FileSet,
    rng: Rng,
    /// Contents of whole-file writes (up to `IO_CHUNK`) and of appends.
    wbuf: Vec<u8>,
    /// Whole-file reads' buffer (`IO_CHUNK`; allocated zeroed, so only the pages
    /// touched become resident).
    rbuf: Vec<u8>,
    file_bytes: u64,
    ops: u64,
}

impl<'a> Worker<'a> {
    fn new(set: &'a FileSet, mut rng: Rng, file_bytes: u64) -> Worker<'a> {
        let mut wbuf = vec![0u8; (file_bytes.min(IO_CHUNK) as usize).max(APPEND_BYTES)];
        rng.fill(&mut wbuf);
        Worker { set, rng, wbuf, rbuf: vec![0u8; IO_CHUNK as usize], file_bytes, ops: 0 }
    }

    /// fileserver.f: create+write whole+close, open+append+close,
    /// open+read whole+close, delete, stat.
    fn fileserver_loop(&mut self) -> Result<(), String> {
        let (id, path, mut f) = self.create()?;
        self.write_whole(&mut f, &path)?;
        drop(f);
        self.set.add(id);
        if let Some((path, mut f)) = self.open_random(OpenOptions::new().append(true))? {
            self.append(&mut f, &path)?;
        }
        if let Some((path, mut f)) = self.open_random(OpenOptions::new().read(true))? {
            self.read_whole(&mut f, &path)?;
        }
        self.delete_random()?;
        self.stat_random()
    }

    /// webproxy.f: delete, create+write whole+close, 5 × (open+read whole+close),
    /// append to the log.
    fn webproxy_loop(&mut self, log: &mut File, log_path: &Path) -> Result<(), String> {
        self.delete_random()?;
        let (id, path, mut f) = self.create()?;
        self.write_whole(&mut f, &path)?;
        drop(f);
        self.set.add(id);
        for _ in 0..WEBPROXY_READS {
            if let Some((path, mut f)) = self.open_random(OpenOptions::new().read(true))? {
                self.read_whole(&mut f, &path)?;
            }
        }
        self.append(log, log_path)
    }

    /// varmail.f: delete, create+append+fsync+close, open+read whole+append+fsync+close,
    /// open+read whole+close.
    fn varmail_loop(&mut self) -> Result<(), String> {
        self.delete_random()?;
        let (id, path, mut f) = self.create()?;
        self.append(&mut f, &path)?;
        self.fsync(&f, &path)?;
        drop(f);
        self.set.add(id);
        if let Some((path, mut f)) = self.open_random(OpenOptions::new().read(true).append(true))? {
            self.read_whole(&mut f, &path)?;
            self.append(&mut f, &path)?;
            self.fsync(&f, &path)?;
        }
        if let Some((path, mut f)) = self.open_random(OpenOptions::new().read(true))? {
            self.read_whole(&mut f, &path)?;
        }
        Ok(())
    }

    /// Creates a file with a fresh name; it joins the set when the caller adds it.
    fn create(&mut self) -> Result<(u64, PathBuf, File), String> {
        let id = self.set.new_id();
        let path = self.set.path(id);
        let f = create_new(&path).map_err(|e| ctx("create", &path, e))?;
        self.ops += 1;
        Ok((id, path, f))
    }

    /// Opens a random live file; `None` if another thread deleted it first.
    fn open_random(&mut self, opts: &OpenOptions) -> Result<Option<(PathBuf, File)>, String> {
        let Some(id) = self.set.pick(&mut self.rng) else { return Ok(None) };
        let path = self.set.path(id);
        match opts.open(&path) {
            Ok(f) => {
                self.ops += 1;
                Ok(Some((path, f)))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(ctx("open", &path, e)),
        }
    }

    fn delete_random(&mut self) -> Result<(), String> {
        let Some(id) = self.set.take(&mut self.rng) else { return Ok(()) };
        let path = self.set.path(id);
        match fs::remove_file(&path) {
            Ok(()) => {
                self.ops += 1;
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(ctx("delete", &path, e)),
        }
    }

    fn stat_random(&mut self) -> Result<(), String> {
        let Some(id) = self.set.pick(&mut self.rng) else { return Ok(()) };
        let path = self.set.path(id);
        match fs::metadata(&path) {
            Ok(_) => {
                self.ops += 1;
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(ctx("stat", &path, e)),
        }
    }

    fn write_whole(&mut self, f: &mut File, path: &Path) -> Result<(), String> {
        write_whole(f, &self.wbuf, self.file_bytes).map_err(|e| ctx("write", path, e))?;
        self.ops += 1;
        Ok(())
    }

    fn append(&mut self, f: &mut File, path: &Path) -> Result<(), String> {
        f.write_all(&self.wbuf[..APPEND_BYTES]).map_err(|e| ctx("append", path, e))?;
        self.ops += 1;
        Ok(())
    }

    fn read_whole(&mut self, f: &mut File, path: &Path) -> Result<(), String> {
        loop {
            match f.read(&mut self.rbuf) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ctx("read", path, e)),
            }
        }
        self.ops += 1;
        Ok(())
    }

    fn fsync(&mut self, f: &File, path: &Path) -> Result<(), String> {
        f.sync_all().map_err(|e| ctx("fsync", path, e))?;
        self.ops += 1;
        Ok(())
    }
}

fn ctx(op: &str, path: &Path, e: io::Error) -> String {
    format!("{op} {}: {e}", path.display())
}

fn create_new(path: &Path) -> io::Result<File> {
    OpenOptions::new().write(true).create_new(true).open(path)
}

/// Writes `bytes` bytes from the start of `buf`, repeated, in writes of at most
/// `buf.len()`.
fn write_whole(f: &mut File, buf: &[u8], bytes: u64) -> io::Result<()> {
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty write buffer"));
        }
        f.write_all(&buf[..n])?;
        left -= n as u64;
    }
    Ok(())
}

/// Holds the threads after their setup until the main thread starts the clock.
#[derive(Default)]
struct Gate {
    /// (threads arrived, open)
    state: Mutex<(usize, bool)>,
    cv: Condvar,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, (usize, bool)> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn arrive_and_wait(&self) {
        let mut g = self.lock();
        g.0 += 1;
        self.cv.notify_all();
        while !g.1 {
            g = self.cv.wait(g).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn wait_ready(&self, n: usize) {
        let mut g = self.lock();
        while g.0 < n {
            g = self.cv.wait(g).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn open(&self) {
        self.lock().1 = true;
        self.cv.notify_all();
    }
}

/// A deterministic generator per thread: `rand`'s small one, seeded from the load's
/// seed and the thread (`stream`).
struct Rng(rand::rngs::SmallRng);

impl Rng {
    fn new(seed: u64, stream: u64) -> Rng {
        use rand::SeedableRng;
        Rng(rand::rngs::SmallRng::seed_from_u64(seed ^ stream.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15)))
    }

    /// Uniform in `0..n`; `n` must not be 0.
    fn below(&mut self, n: u64) -> u64 {
        rand::Rng::gen_range(&mut self.0, 0..n)
    }

    fn fill(&mut self, buf: &mut [u8]) {
        rand::RngCore::fill_bytes(&mut self.0, buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Personality; 4] = Personality::ALL;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("pwfs-personalities-{}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn smoke(p: Personality) {
        let dir = scratch(p.name());
        let load = p.smoke();
        prepare(p, &dir, &load).unwrap();
        let ops = run(p, &dir, &load).unwrap();
        assert!(ops > 0.0, "{}: {ops} ops/s", p.name());
        // A second run works on what the first left.
        let again = run(p, &dir, &load).unwrap();
        assert!(again > 0.0, "{}: second run {again} ops/s", p.name());
        cleanup(p, &dir).unwrap();
        assert!(!dir.join(p.name()).exists());
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0, "{}: leftovers", p.name());
        cleanup(p, &dir).unwrap();
        fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn fileserver_smoke() {
        smoke(Personality::FileServer);
    }

    #[test]
    fn webproxy_smoke() {
        smoke(Personality::WebProxy);
    }

    #[test]
    fn varmail_smoke() {
        smoke(Personality::VarMail);
    }

    #[test]
    fn randomrw_smoke() {
        smoke(Personality::RandomRw);
    }

    #[test]
    fn file_set_keeps_its_size() {
        let p = Personality::WebProxy;
        let dir = scratch("size");
        let load = p.smoke();
        prepare(p, &dir, &load).unwrap();
        run(p, &dir, &load).unwrap();
        // Every loop deletes one file and creates one, so the set ends at its size
        // give or take the loops in flight when the clock stopped.
        let set = FileSet::scan(&dir.join(p.name()), 0).unwrap();
        let n = set.lock().len();
        assert!(n.abs_diff(load.files) <= load.threads, "{n} files");
        cleanup(p, &dir).unwrap();
        fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn run_without_prepare_fails() {
        let dir = scratch("unprepared");
        for p in ALL {
            let err = run(p, &dir, &p.smoke()).unwrap_err();
            assert!(err.contains(p.name()), "{err}");
        }
        fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn sizes() {
        for p in ALL {
            let (full, quick, smoke) = (p.full(), p.quick(), p.smoke());
            assert_eq!(full.threads, quick.threads);
            assert!(quick.files <= full.files && smoke.files <= quick.files);
            assert_eq!(full.duration, Duration::from_secs(10));
            assert_eq!(smoke.threads, 2);
        }
        assert_eq!(Personality::RandomRw.full().file_bytes, 1 << 30);
        assert_eq!(Personality::FileServer.full().files, 10_000);
    }

    #[test]
    fn rng_is_deterministic_per_thread() {
        let draw = |seed, stream| {
            let mut r = Rng::new(seed, stream);
            (0..4).map(|_| r.below(u64::MAX)).collect::<Vec<_>>()
        };
        assert_eq!(draw(42, 0), draw(42, 0));
        assert_ne!(draw(42, 0), draw(42, 1));
        assert_ne!(draw(42, 0), draw(43, 0));
    }
}
