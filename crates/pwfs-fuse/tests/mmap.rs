//! pwrite, pread, MAP_SHARED stores, msync and fsync racing on the same pages of a
//! file through the kernel: every byte ends as the last write to it, in every fetch
//! policy and in the kernel cache modes that allow shared mappings (write-through, the
//! default, and write-back); with the kernel cache off they are refused (ENODEV).
//!
//! The bug report: one thread pwrite()s 8 bytes into every page of a file while another
//! stores into other bytes of the same pages through a MAP_SHARED mapping, then msync
//! and fsync; now and then a pwrite was gone, read back by pread or by a new mapping
//! (ext4: never). The pages start out of both caches (the engine's and the kernel's),
//! so that the engine's non-blocking write path (a write to a page it has not got) runs.
//! Needs root and /dev/fuse (CI has both); elsewhere it says so and does nothing.

mod common;
use common::{can_mount, mount_in};
use pwfs::device::mem::MemDevice;
use pwfs::{Config, FetchPolicy, Fs, MkfsOptions};
use pwfs_fuse::KernelCache;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

const PAGE: usize = 4096;
const PAGES: usize = 64;
const LEN: usize = PAGE * PAGES;
const ROUNDS: u64 = 200;
/// Where the mapping's stores go in each page (the pwrites go to offset 0).
const B_AT: usize = 2048;
const POLICIES: [FetchPolicy; 4] =
    [FetchPolicy::Blocking, FetchPolicy::AsyncForeground, FetchPolicy::AsyncBackground, FetchPolicy::Lazy];

/// What the file held before the race: no byte of it equals a stamp's.
fn pattern(at: usize) -> u8 {
    ((at * 7 + at / PAGE * 13) % 251) as u8
}

/// The pwriter's 8 bytes for `page` in `round`.
fn stamp_a(round: u64, page: usize) -> u64 {
    0xAAAA_0000_0000_0000 | round << 32 | page as u64
}

/// The mapping's 8 bytes for `page` in `round`.
fn stamp_b(round: u64, page: usize) -> u64 {
    0xBBBB_0000_0000_0000 | round << 32 | page as u64
}

/// Names 8 bytes found where a stamp belongs.
fn describe(found: &[u8]) -> String {
    let v = u64::from_le_bytes(found.try_into().unwrap());
    let (round, page) = ((v >> 32) & 0xffff, v & 0xffff_ffff);
    match v >> 48 {
        0xAAAA => format!("{v:#018x} (pwrite of round {round}, page {page})"),
        0xBBBB => format!("{v:#018x} (mapping store of round {round}, page {page})"),
        _ => format!("{v:#018x} (neither stamp: {found:02x?})"),
    }
}

/// Compare `got` with `want` page by page; the first few differing pages, described.
fn compare(got: &[u8], want: &[u8], how: &str) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{how}: {} bytes, expected {}", got.len(), want.len()));
    }
    let mut bad = Vec::new();
    for page in 0..PAGES {
        let r = page * PAGE..(page + 1) * PAGE;
        if got[r.clone()] == want[r.clone()] {
            continue;
        }
        let at = r.start + got[r.clone()].iter().zip(&want[r.clone()]).position(|(a, b)| a != b).unwrap();
        let (a, b) = (r.start, r.start + B_AT);
        let what = match at - r.start {
            0..=7 => {
                format!("the pwrite at 0..8 holds {}, expected {}", describe(&got[a..a + 8]), describe(&want[a..a + 8]))
            }
            o if (B_AT..B_AT + 8).contains(&o) => format!(
                "the mapping store at {B_AT}..{} holds {}, expected {}",
                B_AT + 8,
                describe(&got[b..b + 8]),
                describe(&want[b..b + 8])
            ),
            o => format!("byte {o} is {:#04x}, expected {:#04x}", got[at], want[at]),
        };
        bad.push(format!("page {page}: {what}"));
    }
    if bad.is_empty() {
        return Ok(());
    }
    let n = bad.len();
    bad.truncate(6);
    Err(format!("{how}: {n} of {PAGES} pages wrong; {}", bad.join("; ")))
}

/// xorshift64*: enough randomness for orders, without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// The pages in random order.
    fn shuffled(&mut self) -> Vec<usize> {
        let mut v: Vec<usize> = (0..PAGES).collect();
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
        v
    }
}

/// A shared mapping of a whole file, unmapped on drop. Its address is kept as a number
/// so that threads can share it.
struct Map {
    addr: usize,
}

impl Map {
    fn new(f: &File, prot: i32) -> Map {
        // SAFETY: a fresh shared mapping of LEN bytes of an open file (whose size is
        // LEN); the kernel picks the address. Unmapped in Drop.
        let m = unsafe { libc::mmap(std::ptr::null_mut(), LEN, prot, libc::MAP_SHARED, f.as_raw_fd(), 0) };
        assert_ne!(m, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
        Map { addr: m as usize }
    }

    fn ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }

    /// No read-around on faults: each store faults in its own page only, so that the
    /// pages ahead stay out of the engine's cache for the pwrites.
    fn random_access(&self) {
        // SAFETY: advice on exactly the live mapping.
        let r = unsafe { libc::madvise(self.ptr().cast(), LEN, libc::MADV_RANDOM) };
        assert_eq!(r, 0, "madvise: {}", std::io::Error::last_os_error());
    }

    /// Store 8 bytes at `at` (8-aligned) in one instruction, as a program would.
    fn store(&self, at: usize, v: u64) {
        assert!(at.is_multiple_of(8) && at + 8 <= LEN);
        // SAFETY: in bounds and aligned (checked above) in a live, writable mapping.
        unsafe { self.ptr().add(at).cast::<u64>().write_volatile(v.to_le()) }
    }

    fn msync(&self, at: usize, len: usize, flags: i32) {
        assert!(at.is_multiple_of(PAGE) && at + len <= LEN);
        // SAFETY: a page-aligned range inside the live mapping.
        let r = unsafe { libc::msync(self.ptr().add(at).cast(), len, flags) };
        assert_eq!(r, 0, "msync: {}", std::io::Error::last_os_error());
    }

    fn to_vec(&self) -> Vec<u8> {
        // SAFETY: LEN readable bytes of the live mapping; nobody stores meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr(), LEN) }.to_vec()
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: exactly the range mmap returned, no longer used.
        let r = unsafe { libc::munmap(self.ptr().cast(), LEN) };
        assert_eq!(r, 0, "munmap: {}", std::io::Error::last_os_error());
    }
}

/// Drop the kernel's clean cached pages of the file.
fn drop_kernel_cache(f: &File) {
    // SAFETY: plain syscall on an open descriptor.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0, "posix_fadvise: {}", std::io::Error::from_raw_os_error(r));
}

fn pread_all(f: &File) -> Vec<u8> {
    let mut buf = vec![0u8; LEN];
    f.read_exact_at(&mut buf, 0).expect("pread");
    buf
}

/// The race, ROUNDS times, on one mount; Err names what was wrong.
///
/// The engine and its FUSE server run in this process; the race runs in a child
/// process (this test binary again, as [`client`]). A program faulting on a mapping of
/// a FUSE file must not share its address space with the server that answers the
/// fault: the faulting thread holds the mapping's lock while it waits for the server,
/// and a server thread that grows its heap meanwhile waits for that lock (a hang seen
/// in CI). Between rounds the child asks on its stdout for the engine's cache to be
/// emptied (`@evict`) and waits for the answer on its stdin.
fn stress(policy: FetchPolicy, cache: KernelCache) -> Result<(), String> {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
    let ctx = format!("{policy:?}, kernel cache {cache:?} (seed {seed:#x})");
    let config = || Config {
        cache_bytes: 8 << 20,
        writeback_interval: Some(std::time::Duration::from_millis(50)),
        fetch: policy,
        ..Default::default()
    };
    let dev = Arc::new(MemDevice::new(64 << 20));
    pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
    let fs = Fs::mount(dev.clone(), config()).unwrap();
    let options = pwfs_fuse::MountOptions { allow_other: false, kernel_cache: cache, ..Default::default() };
    let (dir, mounted) = mount_in(&fs, &format!("mmap-{cache:?}-{policy:?}"), &options);
    let path = dir.join("f");
    std::fs::write(&path, initial()).unwrap();
    File::open(&path).unwrap().sync_all().unwrap();

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "client", "--nocapture", "--test-threads=1"])
        .env(CLIENT_ENV, format!("{}\n{seed}", path.display()))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // A hang (the engine's or the kernel's) fails the test instead of stalling CI.
    let pid = child.id() as libc::pid_t;
    let finished = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let finished = finished.clone();
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + CLIENT_LIMIT;
            while !finished.load(Ordering::Acquire) {
                if std::time::Instant::now() > deadline {
                    // SAFETY: a signal to our own child, which has not been waited for.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    return true;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            false
        })
    };
    let mut answer = child.stdin.take().unwrap();
    let mut failure = None;
    let mut done = false;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if line == "@evict" {
            fs.evict_cache().unwrap();
            answer.write_all(b"ok\n").unwrap();
        } else if let Some(why) = line.strip_prefix("@fail ") {
            failure = Some(why.to_string());
        } else if line == "@done" {
            done = true;
        }
    }
    drop(answer);
    let status = child.wait().unwrap();
    finished.store(true, Ordering::Release);
    let timed_out = watchdog.join().unwrap();
    let mut result = match failure {
        Some(why) => Err(format!("{ctx}, {why}")),
        None if timed_out => Err(format!("{ctx}: the racing program still ran after {CLIENT_LIMIT:?}: killed")),
        None if !status.success() || !done => Err(format!("{ctx}: the racing program failed: {status}")),
        None => Ok(()),
    };
    let nbw = fs.nbw_stats();
    eprintln!("{ctx}: {} patches, {} partial-write fetches", nbw.patches_created, nbw.partial_write_fetches);
    // With the kernel's write-back cache, the kernel reads a page before a partial
    // write to it: no write reaches the engine partial, so there is nothing to patch.
    let partial_writes_reach_us = cache != KernelCache::WriteBack;
    if result.is_ok() && policy != FetchPolicy::Blocking && partial_writes_reach_us && nbw.patches_created == 0 {
        result = Err(format!("{ctx}: no pwrite took the non-blocking path; the test tests nothing"));
    }
    mounted.unmount().unwrap();
    fs.unmount().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    result?;

    // Durable: what a fresh mount of the device reads.
    let fs = Fs::mount(dev.clone(), config()).unwrap();
    let got = fs.read_file("/f").unwrap();
    fs.unmount().unwrap();
    compare(&got, &expected(ROUNDS), "after unmount and remount").map_err(|e| format!("{ctx}: {e}"))?;
    let r = pwfs::fsck::check(&*dev).unwrap();
    assert!(r.is_clean(), "{ctx}: fsck: {:?}", r.errors);
    Ok(())
}

/// Where [`stress`] tells its child the file and the seed.
const CLIENT_ENV: &str = "PWFS_MMAP_CLIENT";
/// How long the racing program may take (a round takes milliseconds; 200 rounds under
/// debug assertions on a loaded 2-core machine, well under a minute).
const CLIENT_LIMIT: std::time::Duration = std::time::Duration::from_secs(600);

/// What the file holds before the first round.
fn initial() -> Vec<u8> {
    (0..LEN).map(pattern).collect()
}

/// What the file holds after `rounds` rounds.
fn expected(rounds: u64) -> Vec<u8> {
    let mut want = initial();
    if rounds > 0 {
        for page in 0..PAGES {
            want[page * PAGE..][..8].copy_from_slice(&stamp_a(rounds, page).to_le_bytes());
            want[page * PAGE + B_AT..][..8].copy_from_slice(&stamp_b(rounds, page).to_le_bytes());
        }
    }
    want
}

/// Ask the engine (the parent process) to empty its cache, and wait until it has.
fn evict_engine_cache() {
    // A line of its own: the test harness has printed "test client ... " before it.
    println!("\n@evict");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    assert_eq!(line, "ok\n", "the engine did not evict its cache");
}

/// The racing program [`stress`] runs: the rounds on the mounted file, then what a new
/// mapping and pread read with both caches dropped. A failure is printed as `@fail`.
#[test]
#[ignore = "the program side of the race tests in this file, run by them"]
fn client() {
    let Ok(args) = std::env::var(CLIENT_ENV) else { return };
    let (path, seed) = args.split_once('\n').unwrap();
    match race(Path::new(path), seed.parse().unwrap()) {
        Ok(()) => println!("\n@done"),
        Err(why) => println!("\n@fail {why}"),
    }
}

fn race(path: &Path, seed: u64) -> Result<(), String> {
    let open_rw = || std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let file = open_rw();
    // A mapping that lives through every round (its pages stay in the kernel's cache),
    // used in two rounds of three; the third maps the file afresh.
    let lasting = Map::new(&file, libc::PROT_READ | libc::PROT_WRITE);
    lasting.random_access();

    let mut rng = Rng(seed);
    for round in 1..=ROUNDS {
        // Out of both caches: the pwrites find no page in the engine.
        evict_engine_cache();
        drop_kernel_cache(&file);
        // Odd rounds: both writers walk the pages in the same order, side by side; even
        // rounds: each in its own random order.
        let (order_a, order_b) = if round % 2 == 1 {
            ((0..PAGES).collect(), (0..PAGES).collect())
        } else {
            (rng.shuffled(), rng.shuffled())
        };
        let seeds = (rng.next() | 1, rng.next() | 1);
        let start = Barrier::new(3);
        let done = AtomicBool::new(false);
        let reader_saw: Result<(), String> = std::thread::scope(|s| {
            let a = s.spawn(|| {
                let f = open_rw();
                let mut rng = Rng(seeds.0);
                start.wait();
                for (i, &page) in order_a.iter().enumerate() {
                    f.write_all_at(&stamp_a(round, page).to_le_bytes(), (page * PAGE) as u64).expect("pwrite");
                    if rng.below(16) == 0 || i == PAGES / 2 {
                        f.sync_all().expect("fsync");
                    }
                }
            });
            let b = s.spawn(|| {
                let f = open_rw();
                let fresh = (round % 3 == 0).then(|| Map::new(&f, libc::PROT_READ | libc::PROT_WRITE));
                let map = fresh.as_ref().unwrap_or(&lasting);
                map.random_access();
                let mut rng = Rng(seeds.1);
                start.wait();
                for &page in &order_b {
                    map.store(page * PAGE + B_AT, stamp_b(round, page));
                    match rng.below(8) {
                        0 => map.msync(page * PAGE, PAGE, libc::MS_SYNC),
                        1 => map.msync(0, LEN, libc::MS_SYNC),
                        2 => map.msync(page * PAGE, PAGE, libc::MS_ASYNC),
                        _ => {}
                    }
                }
                map.msync(0, LEN, libc::MS_SYNC);
            });
            let r = s.spawn(|| {
                let f = File::open(path).unwrap();
                let mut rng = Rng(seeds.0 ^ seeds.1 | 1);
                let mut buf = vec![0u8; PAGE];
                start.wait();
                // Bytes nobody writes must read as the pattern at any moment.
                while !done.load(Ordering::Acquire) {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                    let page = rng.below(PAGES);
                    f.read_exact_at(&mut buf, (page * PAGE) as u64).expect("pread");
                    for (o, &b) in buf.iter().enumerate() {
                        if !(0..8).contains(&o) && !(B_AT..B_AT + 8).contains(&o) && b != pattern(page * PAGE + o) {
                            return Err(format!("a concurrent pread of page {page} found byte {o} = {b:#04x}"));
                        }
                    }
                }
                Ok(())
            });
            let writers = [a.join(), b.join()];
            done.store(true, Ordering::Release);
            let saw = r.join().expect("reader thread");
            for w in writers {
                if let Err(p) = w {
                    std::panic::resume_unwind(p);
                }
            }
            saw
        });
        let want = expected(round);
        file.sync_all().unwrap();
        reader_saw
            .and_then(|_| compare(&pread_all(&file), &want, "pread after msync and fsync"))
            .and_then(|_| compare(&Map::new(&file, libc::PROT_READ).to_vec(), &want, "a new mapping"))
            .map_err(|e| format!("round {round}: {e}"))?;
    }
    drop(lasting);
    // What the engine holds, not the kernel's copy.
    let want = expected(ROUNDS);
    evict_engine_cache();
    drop_kernel_cache(&file);
    compare(&Map::new(&file, libc::PROT_READ).to_vec(), &want, "a new mapping, both caches dropped")
        .and_then(|_| {
            drop_kernel_cache(&file);
            compare(&pread_all(&file), &want, "pread, both caches dropped")
        })
        .map_err(|e| format!("after {ROUNDS} rounds: {e}"))
}

/// Every policy on a mount in `cache` mode; all failures reported together.
fn every_policy(cache: KernelCache) {
    if !can_mount() {
        return;
    }
    let t = std::time::Instant::now();
    let failures: Vec<String> = POLICIES.iter().filter_map(|&p| stress(p, cache).err()).collect();
    eprintln!("kernel cache {cache:?}: {} policies in {:.1?}", POLICIES.len(), t.elapsed());
    assert!(failures.is_empty(), "lost writes:\n{}", failures.join("\n"));
}

/// With direct I/O (kernel cache off) a shared mapping would go stale behind direct
/// writes (FUSE_DIRECT_IO_ALLOW_MMAP lost pwrites in this very race): it is refused
/// with ENODEV instead, and a private mapping still reads the file.
#[test]
fn shared_mappings_are_refused_with_the_kernel_cache_off() {
    if !can_mount() {
        return;
    }
    let dev = Arc::new(MemDevice::new(64 << 20));
    pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
    let fs = Fs::mount(dev.clone(), Config { cache_bytes: 8 << 20, ..Default::default() }).unwrap();
    let options = pwfs_fuse::MountOptions { allow_other: false, kernel_cache: KernelCache::Off, ..Default::default() };
    let (dir, mounted) = mount_in(&fs, "mmap-off", &options);
    let path = dir.join("f");
    let want: Vec<u8> = (0..LEN).map(pattern).collect();
    std::fs::write(&path, &want).unwrap();
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: mmap of an open file; the result is checked and unmapped below.
    let m = unsafe { libc::mmap(std::ptr::null_mut(), LEN, prot, libc::MAP_SHARED, f.as_raw_fd(), 0) };
    let e = std::io::Error::last_os_error();
    assert_eq!(m, libc::MAP_FAILED, "a shared mapping of a direct-I/O file was allowed");
    assert_eq!(e.raw_os_error(), Some(libc::ENODEV), "{e}");
    // SAFETY: as above, a private read-only mapping.
    let m = unsafe { libc::mmap(std::ptr::null_mut(), LEN, libc::PROT_READ, libc::MAP_PRIVATE, f.as_raw_fd(), 0) };
    assert_ne!(m, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
    // SAFETY: the mapping is LEN bytes long and readable.
    let got = unsafe { std::slice::from_raw_parts(m as *const u8, LEN) }.to_vec();
    // SAFETY: unmapping what was mapped above.
    unsafe { libc::munmap(m, LEN) };
    assert!(got == want, "a private mapping read other bytes than the file holds");
    drop(f);
    mounted.unmount().unwrap();
    fs.unmount().unwrap();
    let _ = std::fs::remove_dir(&dir);
}

#[test]
fn pwrite_and_mapping_stores_race_kernel_cache_write_back() {
    every_policy(KernelCache::WriteBack);
}

#[test]
fn pwrite_and_mapping_stores_race_kernel_cache_write_through() {
    every_policy(KernelCache::WriteThrough);
}
