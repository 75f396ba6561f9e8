//! Profiling aid: N threads of 4 KiB (or SIZE) overwrites at random offsets of private,
//! cached files on an image file, ops/s — row (a)/(d) of `pwfs bench scale` alone.
//! `cargo run --release --example overwrites -- THREADS SECS IMAGE [SIZE] [FILE_MIB] [DIRTY_RATIO]`
//! (FILE_MIB may be a fraction: 0.5 is 512 KiB).
use pwfs::{Config, MkfsOptions, OpenOptions};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let secs: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(3.0);
    let image = args.next().unwrap_or_else(|| "overwrites.img".into());
    let size: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(4096);
    let file = (args.next().and_then(|a| a.parse::<f64>().ok()).unwrap_or(4.0) * (1u64 << 20) as f64) as u64;
    let dirty_ratio: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(Config::default().dirty_ratio);
    pwfs::mkfs_image(image.as_ref(), 1 << 30, &MkfsOptions::default()).unwrap();
    let fs = pwfs::mount_image(image.as_ref(), Config { cache_bytes: 256 << 20, dirty_ratio, ..Default::default() })
        .unwrap();
    let files: Vec<_> = (0..threads)
        .map(|t| {
            fs.write_file(format!("/a{t}"), &vec![0x11u8; file as usize]).unwrap();
            OpenOptions::new().read(true).write(true).open(&fs, format!("/a{t}")).unwrap()
        })
        .collect();
    fs.sync().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let total = Arc::new(AtomicU64::new(0));
    let hs: Vec<_> = files
        .into_iter()
        .enumerate()
        .map(|(t, f)| {
            let (stop, total) = (stop.clone(), total.clone());
            std::thread::spawn(move || {
                let buf = vec![0x5au8 + t as u8; size as usize];
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    f.write_all_at(&buf, (x % (file / size)) * size).unwrap();
                    i += 1;
                }
                total.fetch_add(i, Ordering::Relaxed);
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_secs_f64(secs));
    stop.store(true, Ordering::Relaxed);
    hs.into_iter().for_each(|h| h.join().unwrap());
    println!("{threads} threads: {:.0} ops/s", total.load(Ordering::Relaxed) as f64 / secs);
    fs.unmount().unwrap();
    let _ = std::fs::remove_file(&image);
}
