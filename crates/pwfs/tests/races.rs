//! Threads racing on one namespace: shared directories, the same names, renames across
//! directories, links, removes and writes at once. Each call may fail only with an errno
//! the race explains; nothing may panic or deadlock; the file system must not be poisoned;
//! after unmount the image is clean (fsck) and every link count matches the names a
//! walk finds. A rename over an existing name is atomic for a concurrent lookup.

mod common;

use common::*;
use pwfs::{Fs, OpenOptions};
use rand::rngs::SmallRng;
use rand::{Rng as _, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// A seeded generator per thread (the rand crate's), with a pick from a list.
struct Rng(SmallRng);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(SmallRng::seed_from_u64(seed))
    }
    fn next(&mut self) -> u64 {
        self.0.gen()
    }
    fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.0.gen_range(0..from.len())]
    }
}

const DIRS: [&str; 5] = ["", "/a", "/b", "/a/s", "/b/x"];
const NAMES: [&str; 6] = ["x", "y", "z", "s", "a", "f"];

fn path(r: &mut Rng) -> String {
    format!("{}/{}", r.pick(&DIRS), r.pick(&NAMES))
}

/// Errnos a race on shared names explains: the name went or came, its kind changed
/// under the caller, a directory got a child, a rename into the subtree being moved.
fn explained(errno: i32) -> bool {
    [libc::ENOENT, libc::EEXIST, libc::ENOTEMPTY, libc::ENOTDIR, libc::EISDIR, libc::EINVAL, libc::EPERM]
        .contains(&errno)
}

fn ok<T>(x: pwfs::Result<T>) -> pwfs::Result<()> {
    x.map(|_| ())
}

fn one_op(fs: &Fs, r: &mut Rng) -> (String, pwfs::Result<()>) {
    let (p, q) = (path(r), path(r));
    match r.next() % 12 {
        0 | 1 => (format!("create {p}"), ok(OpenOptions::new().write(true).create_new(true).open(fs, &p))),
        2 => (format!("mkdir {p}"), ok(fs.create_dir(&p, 0o755))),
        3 => (format!("unlink {p}"), fs.remove_file(&p)),
        4 => (format!("rmdir {p}"), fs.remove_dir(&p)),
        5 | 6 => (format!("rename {p} {q}"), fs.rename_path(&p, &q)),
        7 => (format!("link {p} {q}"), ok(fs.hard_link(&p, &q))),
        8 => {
            let len = (r.next() % 9000) as usize;
            let off = r.next() % 20_000;
            let res = OpenOptions::new().write(true).open(fs, &p).and_then(|f| f.write_at(&vec![7u8; len], off));
            (format!("write {p}"), ok(res))
        }
        9 => {
            let size = r.next() % 20_000;
            (format!("truncate {p}"), OpenOptions::new().write(true).open(fs, &p).and_then(|f| f.set_len(size)))
        }
        10 => {
            let res = fs.resolve(&p, false).and_then(|ino| fs.setxattr(ino, b"user.k", &[1; 40], false, false));
            // The inode can go between the resolve and the call.
            (format!("setxattr {p}"), res)
        }
        _ => {
            let res = fs.metadata(&p).map(|_| ()).and_then(|_| fs.read_dir(&p).map(|_| ()));
            (format!("stat+readdir {p}"), res)
        }
    }
}

/// Every name under `dir`, recursively: (inode, is_dir) per path.
fn walk(fs: &Fs, dir: &str, out: &mut Vec<(String, u64, bool)>) {
    for e in fs.read_dir(if dir.is_empty() { "/" } else { dir }).unwrap() {
        let name = String::from_utf8(e.name).unwrap();
        if name == "." || name == ".." {
            continue;
        }
        let p = format!("{dir}/{name}");
        let is_dir = e.kind == pwfs::FileType::Directory;
        assert_eq!(fs.metadata(&p).unwrap().ino, e.ino, "{p}: readdir and lookup disagree");
        out.push((p.clone(), e.ino, is_dir));
        if is_dir {
            walk(fs, &p, out);
        }
    }
}

/// Link counts: a file's is its names, a directory's 2 plus its subdirectories.
fn check_links(fs: &Fs) {
    let mut all = Vec::new();
    walk(fs, "", &mut all);
    let mut names: HashMap<u64, u32> = HashMap::new();
    for (_, ino, _) in &all {
        *names.entry(*ino).or_default() += 1;
    }
    for (p, ino, is_dir) in &all {
        let md = fs.metadata(p).unwrap();
        if *is_dir {
            let subdirs = all.iter().filter(|(q, _, d)| *d && q.rsplit_once('/').map(|(h, _)| h) == Some(p)).count();
            assert_eq!(md.nlink, 2 + subdirs as u32, "{p}");
            assert_eq!(names[ino], 1, "{p}: a directory with two names");
        } else {
            assert_eq!(md.nlink, names[ino], "{p}: link count against names found");
        }
    }
}

/// Run `f` on a thread and fail, instead of hanging the suite, if it takes too long.
fn within(limit: Duration, what: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(limit) {
        Ok(()) => h.join().unwrap(),
        // The thread panicked: join reports its message.
        Err(mpsc::RecvTimeoutError::Disconnected) => h.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: still running after {limit:?} (deadlock?)"),
    }
}

#[test]
fn shared_namespace_stays_consistent() {
    let rounds: u64 = std::env::var("PWFS_RACE_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(6);
    for round in 0..rounds {
        let dev = Arc::new(pwfs::device::mem::MemDevice::new(64 * MIB));
        // A tiny journal: commits (and their waits) happen in the middle of the races.
        let mkfs = pwfs::MkfsOptions { journal_blocks: Some(64), ..Default::default() };
        pwfs::mkfs(&*dev, &mkfs).unwrap();
        let config = move || pwfs::Config {
            cache_bytes: 64 * 4096,
            writeback_interval: Some(Duration::from_millis(3)),
            ..test_config()
        };
        let fs = Fs::mount(dev.clone(), config()).unwrap();
        for d in ["/a", "/b", "/a/s", "/b/x"] {
            fs.create_dir(d, 0o755).unwrap();
        }
        let fs2 = fs.clone();
        within(Duration::from_secs(120), &format!("round {round}"), move || {
            let handles: Vec<_> = (0..4u64)
                .map(|t| {
                    let fs = fs2.clone();
                    std::thread::spawn(move || {
                        let seed = round * 131 + t * 7 + 1;
                        let mut r = Rng::new(seed);
                        let mut done: HashMap<String, u32> = HashMap::new();
                        for i in 0..1500 {
                            let (what, res) = one_op(&fs, &mut r);
                            match res {
                                Ok(()) => *done.entry(what.split(' ').next().unwrap().to_string()).or_default() += 1,
                                Err(e) => {
                                    assert!(explained(e.errno()), "round {round} thread {t} op {i} {what}: {e}")
                                }
                            }
                        }
                        done
                    })
                })
                .collect();
            let mut done: HashMap<String, u32> = HashMap::new();
            for h in handles {
                for (k, n) in h.join().unwrap() {
                    *done.entry(k).or_default() += n;
                }
            }
            // The race did something: every kind of call succeeded some of the time.
            for kind in ["create", "mkdir", "unlink", "rmdir", "rename", "link", "write", "truncate", "setxattr"] {
                assert!(done.get(kind).copied().unwrap_or(0) > 0, "round {round}: no {kind} succeeded: {done:?}");
            }
        });
        assert_eq!(fs.poisoned(), None, "round {round}");
        check_links(&fs);
        fs.unmount().unwrap();
        fsck_clean(&*dev);
        let fs = Fs::mount(dev.clone(), config()).unwrap();
        check_links(&fs);
        fs.unmount().unwrap();
    }
}

/// rename(2) over an existing name replaces it atomically: a lookup of the name at any
/// moment finds the old file or the new one, never nothing. Within one directory and
/// across two.
#[test]
fn rename_over_a_name_never_hides_it() {
    let (_dev, fs) = mem_fs(64 * MIB);
    fs.create_dir("/d", 0o755).unwrap();
    fs.create_dir("/e", 0o755).unwrap();
    drop(OpenOptions::new().write(true).create_new(true).open(&fs, "/d/t").unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let fs2 = fs.clone();
    let stop2 = stop.clone();
    within(Duration::from_secs(120), "rename race", move || {
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (fs, stop) = (fs2.clone(), stop2.clone());
                std::thread::spawn(move || {
                    let mut seen = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let md = fs.metadata("/d/t").expect("the renamed-over name must always be there");
                        assert!(md.is_file());
                        seen += 1;
                    }
                    seen
                })
            })
            .collect();
        for i in 0..20_000u64 {
            let from = if i % 2 == 0 { "/d/tmp" } else { "/e/tmp" };
            let f = OpenOptions::new().write(true).create_new(true).open(&fs2, from).unwrap();
            f.write_at(&i.to_le_bytes(), 0).unwrap();
            drop(f);
            fs2.rename_path(from, "/d/t").unwrap();
        }
        stop2.store(true, Ordering::Relaxed);
        for r in readers {
            assert!(r.join().unwrap() > 0);
        }
    });
    let f = OpenOptions::new().read(true).open(&fs, "/d/t").unwrap();
    let mut b = [0u8; 8];
    assert_eq!(f.read_at(&mut b, 0).unwrap(), 8);
    assert_eq!(u64::from_le_bytes(b), 19_999);
    assert_eq!(fs.metadata("/d/t").unwrap().nlink, 1);
}

/// A name removed while it is looked up, and its inode number taken at once by a new
/// file in the same directory (a freed number is the next one its directory hands
/// out): the lookup answers ENOENT or the named file, never the newcomer.
#[test]
fn a_lookup_never_answers_with_the_file_that_took_the_number() {
    let (_dev, fs) = mem_fs(64 * MIB);
    fs.create_dir("/d", 0o755).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let fs2 = fs.clone();
    within(Duration::from_secs(120), "reuse race", move || {
        let churn: Vec<_> = [("/d/a", 0o600), ("/d/b", 0o640)]
            .into_iter()
            .map(|(p, mode)| {
                let (fs, stop) = (fs2.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let f = OpenOptions::new().write(true).create_new(true).mode(mode).open(&fs, p).unwrap();
                        drop(f);
                        fs.remove_file(p).unwrap();
                    }
                })
            })
            .collect();
        let (mut found, mut opened) = (0u64, 0u64);
        for _ in 0..200_000 {
            if let Ok(md) = fs2.metadata("/d/a") {
                assert_eq!(md.permissions() & 0o777, 0o600, "stat of /d/a answered with /d/b's inode");
                found += 1;
            }
            if let Ok(f) = OpenOptions::new().read(true).open(&fs2, "/d/a") {
                assert_eq!(f.metadata().unwrap().permissions() & 0o777, 0o600, "open of /d/a opened /d/b");
                opened += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        for h in churn {
            h.join().unwrap();
        }
        assert!(found > 0 && opened > 0, "the race never found the file ({found}, {opened})");
    });
}

/// RENAME_WHITEOUT leaves a whiteout in the source's place in the same change: a
/// lookup of the source name finds the file or the whiteout, never nothing.
#[test]
fn a_whiteout_takes_the_name_without_a_gap() {
    let (_dev, fs) = mem_fs(64 * MIB);
    fs.create_dir("/d", 0o755).unwrap();
    drop(OpenOptions::new().write(true).create_new(true).open(&fs, "/d/s").unwrap());
    let d = fs.metadata("/d").unwrap().ino;
    let stop = Arc::new(AtomicBool::new(false));
    let (fs2, stop2) = (fs.clone(), stop.clone());
    within(Duration::from_secs(120), "whiteout race", move || {
        let reader = {
            let (fs, stop) = (fs2.clone(), stop2.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    fs.metadata("/d/s").expect("the source name must always be there");
                }
            })
        };
        for _ in 0..20_000 {
            fs2.rename_whiteout(d, b"s", d, b"t", false, (0, 0)).unwrap();
            fs2.rename_path("/d/t", "/d/s").unwrap();
        }
        stop2.store(true, Ordering::Relaxed);
        reader.join().unwrap();
    });
}

/// O_APPEND writes from two threads never overlap, also when one of them is larger
/// than the engine's 4 MiB write piece (each piece took the file's lock on its own,
/// and a small append landing between two pieces was overwritten by the next), and
/// with a cache far smaller than one write.
#[test]
fn large_and_small_appends_do_not_overlap() {
    let dev = Arc::new(pwfs::device::mem::MemDevice::new(256 * MIB));
    pwfs::mkfs(&*dev, &pwfs::MkfsOptions::default()).unwrap();
    let config =
        pwfs::Config { cache_bytes: 256 * 4096, writeback_interval: Some(Duration::from_millis(3)), ..test_config() };
    let fs = Fs::mount(dev, config).unwrap();
    drop(OpenOptions::new().write(true).create_new(true).open(&fs, "/log").unwrap());
    const BIG: usize = 9 << 20;
    const SMALL: usize = 100;
    let fs2 = fs.clone();
    let bigs = 6usize;
    let smalls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let smalls2 = smalls.clone();
    within(Duration::from_secs(300), "append race", move || {
        let done = Arc::new(AtomicBool::new(false));
        let small: Vec<_> = (0..2)
            .map(|_| {
                let (fs, done, smalls) = (fs2.clone(), done.clone(), smalls2.clone());
                std::thread::spawn(move || {
                    let f = OpenOptions::new().append(true).open(&fs, "/log").unwrap();
                    while !done.load(Ordering::Relaxed) {
                        assert_eq!(f.write(&[b'z'; SMALL]).unwrap(), SMALL);
                        smalls.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let f = OpenOptions::new().append(true).open(&fs2, "/log").unwrap();
        for i in 0..bigs {
            assert_eq!(f.write(&vec![b'A' + i as u8; BIG]).unwrap(), BIG);
        }
        done.store(true, Ordering::Relaxed);
        small.into_iter().for_each(|h| h.join().unwrap());
    });
    let smalls = smalls.load(Ordering::Relaxed);
    let data = fs.read_file("/log").unwrap();
    assert_eq!(data.len(), bigs * BIG + smalls * SMALL);
    // Runs of one byte value: every big record whole, small ones in multiples of SMALL.
    let mut at = 0;
    let mut seen_big = vec![false; bigs];
    while at < data.len() {
        let v = data[at];
        let run = data[at..].iter().take_while(|b| **b == v).count();
        if v == b'z' {
            assert_eq!(run % SMALL, 0, "a small append cut at {at}");
        } else {
            let i = (v - b'A') as usize;
            assert!(i < bigs && !seen_big[i], "byte {v} at {at}");
            assert_eq!(run, BIG, "big append {i} cut at {at}");
            seen_big[i] = true;
        }
        at += run;
    }
}

/// A punch (always KEEP_SIZE) racing a truncate never grows the file: it read the
/// size before taking the file's lock and zeroed its edge block past a size cut
/// meanwhile. Every size seen is one the writer set.
#[test]
fn a_punch_racing_a_truncate_never_grows_the_file() {
    use pwfs::fs::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE};
    let (_dev, fs) = mem_fs(64 * MIB);
    drop(OpenOptions::new().write(true).create_new(true).open(&fs, "/f").unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let (fs2, stop2) = (fs.clone(), stop.clone());
    within(Duration::from_secs(120), "punch race", move || {
        let puncher = {
            let (fs, stop) = (fs2.clone(), stop2.clone());
            std::thread::spawn(move || {
                let f = OpenOptions::new().write(true).open(&fs, "/f").unwrap();
                while !stop.load(Ordering::Relaxed) {
                    f.allocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 100, 3996).unwrap();
                }
            })
        };
        let f = OpenOptions::new().write(true).open(&fs2, "/f").unwrap();
        for _ in 0..20_000 {
            f.write_at(&[5u8; 10_000], 0).unwrap();
            let size = f.metadata().unwrap().size;
            assert!(size == 10_000, "size {size} after writing 10,000 bytes at 0");
            f.set_len(50).unwrap();
            let size = f.metadata().unwrap().size;
            assert!(size == 50, "size {size} after a truncate to 50: a punch grew the file");
        }
        stop2.store(true, Ordering::Relaxed);
        puncher.join().unwrap();
    });
}

/// Writes to pages already dirty skip listing them again (`Page::listed`) while
/// write-back and commits take the dirty set over and over: no write may be left
/// behind. One thread rewrites four cached pages with a counter, another syncs in a
/// loop; after a last sync and a remount every page holds the last value written to it.
#[test]
fn rewrites_racing_write_back_are_never_left_behind() {
    within(Duration::from_secs(120), "rewrites racing write-back", || {
        for seed in 0..4u64 {
            let (dev, fs) = mem_fs(32 * MIB);
            let f = OpenOptions::new().read(true).write(true).create(true).open(&fs, "/f").unwrap();
            f.write_at(&[0u8; 4 * 4096], 0).unwrap();
            fs.sync().unwrap();
            let done = Arc::new(AtomicBool::new(false));
            let syncer = {
                let (fs, done) = (fs.clone(), done.clone());
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while !done.load(Ordering::Relaxed) {
                        fs.sync().unwrap();
                        n += 1;
                    }
                    n
                })
            };
            let mut r = Rng::new(seed);
            let mut last = [0u64; 4];
            for i in 1..=20_000u64 {
                let page = (r.next() % 4) as usize;
                let word = (i << 8 | page as u64).to_le_bytes();
                f.write_at(&word.repeat(512), page as u64 * 4096).unwrap();
                last[page] = i;
            }
            done.store(true, Ordering::Relaxed);
            assert!(syncer.join().unwrap() > 0);
            fs.sync().unwrap();
            drop(f);
            fs.unmount().unwrap();
            let fs = Fs::mount(dev.clone(), test_config()).unwrap();
            let got = fs.read_file("/f").unwrap();
            for (page, want) in last.iter().enumerate() {
                let word = u64::from_le_bytes(got[page * 4096..page * 4096 + 8].try_into().unwrap());
                assert_eq!(word, want << 8 | page as u64, "seed {seed}: page {page} lost its last write");
                assert!(got[page * 4096..(page + 1) * 4096].chunks(8).all(|c| c == &got[page * 4096..page * 4096 + 8]));
            }
            fs.unmount().unwrap();
            fsck_clean(&*dev);
        }
    });
}

/// Write-back under pressure writes the files dirtied longest ago first, only as many
/// as bring the dirty pages under a quarter of the limit: a file being written keeps
/// its pages (its writers do not meet them lent to the device).
#[test]
fn write_back_under_pressure_takes_the_files_dirtied_longest_ago() {
    const PAGE: usize = 4096;
    // 256 pages of cache, a dirty limit of 128 pages: under pressure, write-back brings
    // the dirty pages under 32.
    let config = pwfs::Config { cache_bytes: 256 * PAGE as u64, dirty_ratio: 0.5, ..test_config() };
    let dev = Arc::new(pwfs::device::mem::MemDevice::new(32 * MIB));
    pwfs::mkfs(&*dev, &pwfs::MkfsOptions::default()).unwrap();
    let fs = Fs::mount(dev.clone(), config).unwrap();
    for name in ["/old", "/new", "/other"] {
        fs.write_file(name, &vec![1u8; 40 * PAGE]).unwrap();
    }
    fs.sync().unwrap();
    let open = |p: &str| OpenOptions::new().write(true).open(&fs, p).unwrap();
    let (old, new, other) = (open("/old"), open("/new"), open("/other"));
    old.write_at(&vec![2u8; 40 * PAGE], 0).unwrap();
    // A write-back in between (an fdatasync of another file): what is dirtied after it
    // is younger.
    other.write_at(&[3u8; PAGE], 0).unwrap();
    other.sync_data().unwrap();
    new.write_at(&vec![4u8; 20 * PAGE], 0).unwrap();
    // 60 dirty pages: 28 must go, and the 40 of the older file are enough.
    let written = || fs.device_counters().bytes_written;
    let before = written();
    fs.write_back_under_pressure().unwrap();
    assert_eq!(written() - before, 40 * PAGE as u64, "the older file, whole, and nothing else");
    let before = written();
    fs.write_back().unwrap();
    assert_eq!(written() - before, 20 * PAGE as u64, "the newer file was left dirty");
    drop((old, new, other));
    fs.sync().unwrap();
    fs.unmount().unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.read_file("/old").unwrap(), vec![2u8; 40 * PAGE]);
    assert_eq!(&fs.read_file("/new").unwrap()[..20 * PAGE], &vec![4u8; 20 * PAGE][..]);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}
