//! Property tests: random operation sequences run against Patchwork and against an
//! in-memory model of POSIX file semantics; every result (data, sizes, link counts,
//! errno) must agree, before and after a remount. Also from several threads at once.

mod common;
use common::*;
use proptest::prelude::*;
use pwfs::{Fs, OpenOptions};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

#[derive(Debug, Clone)]
enum Node {
    File(Vec<u8>),
    Dir(BTreeMap<String, u64>),
}

/// The model: inodes with link counts, resolved the way POSIX resolves paths.
#[derive(Debug, Clone)]
struct Model {
    nodes: HashMap<u64, (Node, u32)>,
    /// Permission bits and extended attributes of every node.
    attrs: HashMap<u64, (u32, BTreeMap<String, Vec<u8>>)>,
    next: u64,
}

type R<T> = Result<T, i32>;

impl Model {
    fn new() -> Model {
        Model {
            nodes: HashMap::from([(1, (Node::Dir(BTreeMap::new()), 2))]),
            attrs: HashMap::from([(1, (0o755, BTreeMap::new()))]),
            next: 2,
        }
    }

    fn dir(&self, ino: u64) -> Option<&BTreeMap<String, u64>> {
        match &self.nodes[&ino].0 {
            Node::Dir(d) => Some(d),
            _ => None,
        }
    }

    /// (parent inode, last name) of a path like "/a/b/x".
    fn parent(&self, path: &str) -> R<(u64, String)> {
        let comps: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
        let mut cur = 1;
        for c in &comps[..comps.len() - 1] {
            let d = self.dir(cur).ok_or(libc::ENOTDIR)?;
            cur = *d.get(*c).ok_or(libc::ENOENT)?;
        }
        self.dir(cur).ok_or(libc::ENOTDIR)?;
        Ok((cur, comps.last().unwrap().to_string()))
    }

    fn lookup(&self, path: &str) -> R<u64> {
        let (p, name) = self.parent(path)?;
        self.dir(p).unwrap().get(&name).copied().ok_or(libc::ENOENT)
    }

    fn is_dir(&self, ino: u64) -> bool {
        matches!(self.nodes[&ino].0, Node::Dir(_))
    }

    fn add(&mut self, parent: u64, name: &str, ino: u64) {
        if let Node::Dir(d) = &mut self.nodes.get_mut(&parent).unwrap().0 {
            d.insert(name.to_string(), ino);
        }
    }

    fn del(&mut self, parent: u64, name: &str) {
        if let Node::Dir(d) = &mut self.nodes.get_mut(&parent).unwrap().0 {
            d.remove(name);
        }
    }

    fn unref(&mut self, ino: u64, dir: bool) {
        let n = self.nodes.get_mut(&ino).unwrap();
        n.1 = if dir { 0 } else { n.1 - 1 };
        if n.1 == 0 {
            self.nodes.remove(&ino);
            self.attrs.remove(&ino);
        }
    }

    fn apply(&mut self, op: &Op) -> R<Out> {
        match op {
            Op::Create(p) => {
                let (parent, name) = self.parent(p)?;
                if self.dir(parent).unwrap().contains_key(&name) {
                    return Err(libc::EEXIST);
                }
                let ino = self.next;
                self.next += 1;
                self.nodes.insert(ino, (Node::File(Vec::new()), 1));
                self.attrs.insert(ino, (0o644, BTreeMap::new()));
                self.add(parent, &name, ino);
                Ok(Out::None)
            }
            Op::Mkdir(p) => {
                let (parent, name) = self.parent(p)?;
                if self.dir(parent).unwrap().contains_key(&name) {
                    return Err(libc::EEXIST);
                }
                let ino = self.next;
                self.next += 1;
                self.nodes.insert(ino, (Node::Dir(BTreeMap::new()), 2));
                self.attrs.insert(ino, (0o755, BTreeMap::new()));
                self.add(parent, &name, ino);
                self.nodes.get_mut(&parent).unwrap().1 += 1;
                Ok(Out::None)
            }
            Op::Write(p, off, len, byte) => {
                let ino = self.lookup(p)?;
                match &mut self.nodes.get_mut(&ino).unwrap().0 {
                    Node::Dir(_) => Err(libc::EISDIR),
                    Node::File(data) => {
                        let end = *off as usize + *len as usize;
                        if data.len() < end {
                            data.resize(end, 0);
                        }
                        data[*off as usize..end].fill(*byte);
                        Ok(Out::None)
                    }
                }
            }
            Op::Truncate(p, size) => {
                let ino = self.lookup(p)?;
                match &mut self.nodes.get_mut(&ino).unwrap().0 {
                    Node::Dir(_) => Err(libc::EISDIR),
                    Node::File(data) => {
                        data.resize(*size as usize, 0);
                        Ok(Out::None)
                    }
                }
            }
            Op::Read(p, off, len) => {
                let ino = self.lookup(p)?;
                match &self.nodes[&ino].0 {
                    Node::Dir(_) => Err(libc::EISDIR),
                    Node::File(data) => {
                        let from = (*off as usize).min(data.len());
                        let to = (*off as usize + *len as usize).min(data.len());
                        Ok(Out::Data(data[from..to].to_vec()))
                    }
                }
            }
            Op::Stat(p) => {
                let ino = self.lookup(p)?;
                let (node, nlink) = &self.nodes[&ino];
                let (dir, size) = match node {
                    Node::Dir(_) => (true, 0),
                    Node::File(d) => (false, d.len() as u64),
                };
                Ok(Out::Stat { dir, size, nlink: *nlink, mode: self.attrs[&ino].0 })
            }
            Op::Populate(n) => {
                for i in 0..*n {
                    let name = format!("p{i}");
                    if !self.dir(1).unwrap().contains_key(&name) {
                        let ino = self.next;
                        self.next += 1;
                        self.nodes.insert(ino, (Node::File(Vec::new()), 1));
                        self.attrs.insert(ino, (0o644, BTreeMap::new()));
                        self.add(1, &name, ino);
                    }
                }
                Ok(Out::None)
            }
            Op::ChmodTree(mode) => {
                for (ino, a) in self.attrs.iter_mut() {
                    if *ino != 1 {
                        a.0 = *mode;
                    }
                }
                Ok(Out::None)
            }
            Op::Chmod(p, mode) => {
                let ino = self.lookup(p)?;
                self.attrs.get_mut(&ino).unwrap().0 = *mode;
                Ok(Out::None)
            }
            Op::SetXattr(p, k, len) => {
                let ino = self.lookup(p)?;
                self.attrs.get_mut(&ino).unwrap().1.insert(format!("user.k{k}"), vec![*k; *len as usize]);
                Ok(Out::None)
            }
            Op::RemoveXattr(p, k) => {
                let ino = self.lookup(p)?;
                self.attrs.get_mut(&ino).unwrap().1.remove(&format!("user.k{k}")).ok_or(libc::ENODATA)?;
                Ok(Out::None)
            }
            Op::GetXattrs(p) => {
                let ino = self.lookup(p)?;
                Ok(Out::Xattrs(self.attrs[&ino].1.iter().map(|(k, v)| (k.clone(), v.clone())).collect()))
            }
            Op::Unlink(p) => {
                let (parent, name) = self.parent(p)?;
                let ino = *self.dir(parent).unwrap().get(&name).ok_or(libc::ENOENT)?;
                if self.is_dir(ino) {
                    return Err(libc::EISDIR);
                }
                self.del(parent, &name);
                self.unref(ino, false);
                Ok(Out::None)
            }
            Op::Rmdir(p) => {
                let (parent, name) = self.parent(p)?;
                let ino = *self.dir(parent).unwrap().get(&name).ok_or(libc::ENOENT)?;
                match self.dir(ino) {
                    None => return Err(libc::ENOTDIR),
                    Some(d) if !d.is_empty() => return Err(libc::ENOTEMPTY),
                    _ => {}
                }
                self.del(parent, &name);
                self.unref(ino, true);
                self.nodes.get_mut(&parent).unwrap().1 -= 1;
                Ok(Out::None)
            }
            Op::Link(a, b) => {
                let ino = self.lookup(a)?;
                let (parent, name) = self.parent(b)?;
                if self.dir(parent).unwrap().contains_key(&name) {
                    return Err(libc::EEXIST);
                }
                if self.is_dir(ino) {
                    return Err(libc::EPERM);
                }
                self.add(parent, &name, ino);
                self.nodes.get_mut(&ino).unwrap().1 += 1;
                Ok(Out::None)
            }
            Op::Rename(a, b) => {
                let (sp, sname) = self.parent(a)?;
                let (dp, dname) = self.parent(b)?;
                let src = *self.dir(sp).unwrap().get(&sname).ok_or(libc::ENOENT)?;
                let dst = self.dir(dp).unwrap().get(&dname).copied();
                if dst == Some(src) {
                    return Ok(Out::None);
                }
                let src_dir = self.is_dir(src);
                if src_dir && (b.starts_with(&format!("{a}/")) || dp == src) {
                    return Err(libc::EINVAL);
                }
                if let Some(d) = dst {
                    // The kernel's "trap": a target directory holding the source.
                    if a.starts_with(&format!("{b}/")) {
                        return Err(libc::ENOTEMPTY);
                    }
                    match (src_dir, self.dir(d)) {
                        (true, None) => return Err(libc::ENOTDIR),
                        (false, Some(_)) => return Err(libc::EISDIR),
                        (true, Some(x)) if !x.is_empty() => return Err(libc::ENOTEMPTY),
                        _ => {}
                    }
                    let d_dir = self.is_dir(d);
                    self.del(dp, &dname);
                    if d_dir {
                        self.nodes.get_mut(&dp).unwrap().1 -= 1;
                    }
                    self.unref(d, d_dir);
                }
                self.del(sp, &sname);
                self.add(dp, &dname, src);
                if src_dir && sp != dp {
                    self.nodes.get_mut(&sp).unwrap().1 -= 1;
                    self.nodes.get_mut(&dp).unwrap().1 += 1;
                }
                Ok(Out::None)
            }
            Op::Sync | Op::Remount | Op::Evict => Ok(Out::None),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Out {
    None,
    Data(Vec<u8>),
    Stat { dir: bool, size: u64, nlink: u32, mode: u32 },
    Xattrs(Vec<(String, Vec<u8>)>),
}

#[derive(Debug, Clone)]
enum Op {
    Create(String),
    Mkdir(String),
    Write(String, u32, u32, u8),
    Truncate(String, u32),
    Read(String, u32, u32),
    Stat(String),
    Unlink(String),
    Rmdir(String),
    Link(String, String),
    Rename(String, String),
    Chmod(String, u32),
    /// Create files p0..pN in the root (the names that are free).
    Populate(u32),
    /// chmod every node but the root.
    ChmodTree(u32),
    SetXattr(String, u8, u8),
    RemoveXattr(String, u8),
    GetXattrs(String),
    Sync,
    Remount,
    Evict,
}

fn run_op(fs: &Fs, op: &Op) -> R<Out> {
    let e = |e: pwfs::Error| e.errno();
    match op {
        Op::Create(p) => OpenOptions::new().write(true).create_new(true).open(fs, p).map(|_| Out::None).map_err(e),
        Op::Mkdir(p) => fs.create_dir(p, 0o755).map(|_| Out::None).map_err(e),
        Op::Write(p, off, len, byte) => {
            let f = OpenOptions::new().write(true).open(fs, p).map_err(e)?;
            f.write_at(&vec![*byte; *len as usize], *off as u64).map(|_| Out::None).map_err(e)
        }
        Op::Truncate(p, size) => {
            let f = OpenOptions::new().write(true).open(fs, p).map_err(e)?;
            f.set_len(*size as u64).map(|_| Out::None).map_err(e)
        }
        Op::Read(p, off, len) => {
            let f = OpenOptions::new().read(true).open(fs, p).map_err(e)?;
            let mut buf = vec![0; *len as usize];
            let n = f.read_at(&mut buf, *off as u64).map_err(e)?;
            buf.truncate(n);
            Ok(Out::Data(buf))
        }
        Op::Stat(p) => fs
            .metadata(p)
            .map(|m| Out::Stat {
                dir: m.is_dir(),
                size: if m.is_dir() { 0 } else { m.size },
                nlink: m.nlink,
                mode: m.permissions(),
            })
            .map_err(e),
        Op::Chmod(p, mode) => fs.set_permissions(p, *mode).map(|_| Out::None).map_err(e),
        Op::Populate(n) => {
            for i in 0..*n {
                match OpenOptions::new().write(true).create_new(true).open(fs, format!("/p{i}")) {
                    Ok(_) => {}
                    Err(x) if x.errno() == libc::EEXIST => {}
                    Err(x) => return Err(x.errno()),
                }
            }
            Ok(Out::None)
        }
        Op::ChmodTree(mode) => {
            let mut stack = vec![String::new()];
            while let Some(d) = stack.pop() {
                for entry in fs.read_dir(if d.is_empty() { "/" } else { &d }).map_err(e)? {
                    let name = String::from_utf8(entry.name).unwrap();
                    if name == "." || name == ".." {
                        continue;
                    }
                    let p = format!("{d}/{name}");
                    fs.set_permissions(&p, *mode).map_err(e)?;
                    if entry.kind == pwfs::FileType::Directory {
                        stack.push(p);
                    }
                }
            }
            Ok(Out::None)
        }
        Op::SetXattr(p, k, len) => {
            let ino = fs.resolve(p, true).map_err(e)?;
            let name = format!("user.k{k}");
            fs.setxattr(ino, name.as_bytes(), &vec![*k; *len as usize], false, false).map(|_| Out::None).map_err(e)
        }
        Op::RemoveXattr(p, k) => {
            let ino = fs.resolve(p, true).map_err(e)?;
            fs.removexattr(ino, format!("user.k{k}").as_bytes()).map(|_| Out::None).map_err(e)
        }
        Op::GetXattrs(p) => {
            let ino = fs.resolve(p, true).map_err(e)?;
            let mut out = Vec::new();
            for name in fs.listxattr(ino).map_err(e)? {
                let v = fs.getxattr(ino, &name).map_err(e)?;
                out.push((String::from_utf8(name).unwrap(), v));
            }
            out.sort();
            Ok(Out::Xattrs(out))
        }
        Op::Unlink(p) => fs.remove_file(p).map(|_| Out::None).map_err(e),
        Op::Rmdir(p) => fs.remove_dir(p).map(|_| Out::None).map_err(e),
        Op::Link(a, b) => fs.hard_link(a, b).map(|_| Out::None).map_err(e),
        Op::Rename(a, b) => fs.rename_path(a, b).map(|_| Out::None).map_err(e),
        Op::Sync => fs.sync().map(|_| Out::None).map_err(e),
        Op::Evict => fs.evict_cache().map(|_| Out::None).map_err(e),
        Op::Remount => Ok(Out::None),
    }
}

fn path(prefix: &'static str) -> impl Strategy<Value = String> {
    let dirs = prop::sample::select(vec!["", "/a", "/a/b", "/c", "/x"]);
    let names = prop::sample::select(vec!["x", "y", "a", "b", "c"]);
    (dirs, names).prop_map(move |(d, n)| format!("{prefix}{d}/{n}"))
}

fn op(prefix: &'static str) -> impl Strategy<Value = Op> {
    let size = prop_oneof![0u32..10, 4090u32..4100, 0u32..20_000];
    prop_oneof![
        3 => path(prefix).prop_map(Op::Create),
        3 => path(prefix).prop_map(Op::Mkdir),
        5 => (path(prefix), size.clone(), 1u32..9000, any::<u8>()).prop_map(|(p, o, l, b)| Op::Write(p, o, l, b)),
        2 => (path(prefix), size.clone()).prop_map(|(p, s)| Op::Truncate(p, s)),
        4 => (path(prefix), size, 1u32..10_000).prop_map(|(p, o, l)| Op::Read(p, o, l)),
        2 => path(prefix).prop_map(Op::Stat),
        2 => path(prefix).prop_map(Op::Unlink),
        2 => path(prefix).prop_map(Op::Rmdir),
        1 => (path(prefix), path(prefix)).prop_map(|(a, b)| Op::Link(a, b)),
        2 => (path(prefix), path(prefix)).prop_map(|(a, b)| Op::Rename(a, b)),
        2 => (path(prefix), 0u32..0o1000).prop_map(|(p, m)| Op::Chmod(p, m)),
        2 => (path(prefix), 0u8..4, 1u8..200).prop_map(|(p, k, l)| Op::SetXattr(p, k, l)),
        1 => (path(prefix), 0u8..4).prop_map(|(p, k)| Op::RemoveXattr(p, k)),
        1 => path(prefix).prop_map(Op::GetXattrs),
        1 => Just(Op::Sync),
        1 => Just(Op::Evict),
        1 => Just(Op::Remount),
    ]
}

fn check_sequence(ops: &[Op], fetch: pwfs::FetchPolicy) -> Result<(), TestCaseError> {
    check_sequence_on(ops, fetch, 32 * MIB, &pwfs::MkfsOptions::default())
}

fn check_sequence_on(
    ops: &[Op],
    fetch: pwfs::FetchPolicy,
    size: u64,
    mkfs: &pwfs::MkfsOptions,
) -> Result<(), TestCaseError> {
    let dev = Arc::new(pwfs::device::mem::MemDevice::new(size));
    pwfs::mkfs(&*dev, mkfs).unwrap();
    // A tiny cache, so that eviction and write-back run during the sequence.
    let config = || pwfs::Config { cache_bytes: 64 * 4096, fetch, ..test_config() };
    let mut fs = Fs::mount(dev.clone(), config()).unwrap();
    let mut model = Model::new();
    for (i, op) in ops.iter().enumerate() {
        if let Op::Remount = op {
            fs.unmount().unwrap();
            fsck_clean(&*dev);
            fs = Fs::mount(dev.clone(), config()).unwrap();
        }
        let want = model.apply(op);
        let got = run_op(&fs, op);
        prop_assert_eq!(&got, &want, "op {} {:?}", i, op);
        prop_assert_eq!(fs.poisoned(), None, "op {} {:?}", i, op);
    }
    // The live tree (names from the in-memory index, data from the cache) is the
    // model's, and again read cold.
    compare_tree(&fs, &model, "", 1)?;
    fs.evict_cache().unwrap();
    compare_tree(&fs, &model, "", 1)?;
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    // Nothing acknowledged is lost: after a remount every node is the model's.
    let fs = Fs::mount(dev.clone(), config()).unwrap();
    compare_tree(&fs, &model, "", 1)?;
    fs.unmount().unwrap();
    Ok(())
}

/// Every name, size, link count, mode, attribute and byte under `path` is the model's.
fn compare_tree(fs: &Fs, model: &Model, path: &str, ino: u64) -> Result<(), TestCaseError> {
    let dir = model.dir(ino).unwrap().clone();
    let mut names: Vec<String> = fs
        .read_dir(if path.is_empty() { "/" } else { path })
        .unwrap()
        .into_iter()
        .map(|e| String::from_utf8(e.name).unwrap())
        .filter(|n| n != "." && n != "..")
        .collect();
    names.sort();
    prop_assert_eq!(&names, &dir.keys().cloned().collect::<Vec<_>>(), "names in {:?}", path);
    for (name, child) in dir {
        let p = format!("{path}/{name}");
        for op in [Op::Stat(p.clone()), Op::GetXattrs(p.clone()), Op::Read(p.clone(), 0, 100_000)] {
            let want = model.clone().apply(&op);
            let want = if model.is_dir(child) && matches!(op, Op::Read(..)) { Err(libc::EISDIR) } else { want };
            prop_assert_eq!(run_op(fs, &op), want, "after remount: {:?}", op);
        }
        if model.is_dir(child) {
            compare_tree(fs, model, &p, child)?;
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn random_sequences_match_the_model(ops in prop::collection::vec(op(""), 1..120)) {
        check_sequence(&ops, pwfs::FetchPolicy::Blocking)?;
    }

    /// A journal as small as mkfs allows: the running transaction must commit before
    /// it outgrows the log, whatever the mix of operations, and nothing is lost.
    #[test]
    fn random_sequences_with_a_tiny_journal(
        ops in prop::collection::vec(prop_oneof![
            12 => op(""),
            1 => (100u32..700).prop_map(Op::Populate),
            1 => (0u32..0o1000).prop_map(Op::ChmodTree),
        ], 1..200),
        policy in prop::sample::select(vec![pwfs::FetchPolicy::Blocking, pwfs::FetchPolicy::AsyncForeground]),
    ) {
        let mkfs = pwfs::MkfsOptions { inodes: Some(2048), journal_blocks: Some(33) };
        check_sequence_on(&ops, policy, 16 * MIB, &mkfs)?;
    }

    /// The same under every non-blocking fetch policy (patches, deferred fetches).
    #[test]
    fn random_sequences_match_the_model_with_nbw(
        ops in prop::collection::vec(op(""), 1..120),
        policy in prop::sample::select(vec![
            pwfs::FetchPolicy::AsyncForeground,
            pwfs::FetchPolicy::AsyncBackground,
            pwfs::FetchPolicy::Lazy,
        ]),
    ) {
        check_sequence(&ops, policy)?;
    }
}

/// Several threads, each with its own subtree and model, on one file system.
#[test]
fn threads_match_their_models() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, TestRunner};
    for round in 0..8u64 {
        // A small cache and a busy write-back thread: background write-back and
        // throttling race with the operations.
        let dev = Arc::new(pwfs::device::mem::MemDevice::new(64 * MIB));
        pwfs::mkfs(&*dev, &pwfs::MkfsOptions::default()).unwrap();
        let policies = [
            pwfs::FetchPolicy::Blocking,
            pwfs::FetchPolicy::AsyncForeground,
            pwfs::FetchPolicy::AsyncBackground,
            pwfs::FetchPolicy::Lazy,
        ];
        let config = pwfs::Config {
            cache_bytes: 96 * 4096,
            writeback_interval: Some(std::time::Duration::from_millis(5)),
            fetch: policies[round as usize % 4],
            ..test_config()
        };
        let fs = Fs::mount(dev.clone(), config).unwrap();
        let prefixes: [&'static str; 4] = ["/t0", "/t1", "/t2", "/t3"];
        for p in prefixes {
            fs.create_dir(p, 0o755).unwrap();
        }
        let mut handles = Vec::new();
        for (t, prefix) in prefixes.into_iter().enumerate() {
            let fs = fs.clone();
            handles.push(std::thread::spawn(move || {
                let seed = round * 16 + t as u64;
                let mut runner = TestRunner::new_with_rng(
                    Config::default(),
                    proptest::test_runner::TestRng::from_seed(
                        proptest::test_runner::RngAlgorithm::ChaCha,
                        &[seed as u8; 32],
                    ),
                );
                let ops = prop::collection::vec(op(prefix), 150).new_tree(&mut runner).unwrap().current();
                let mut model = Model::new();
                // The model's root stands for this thread's "/tN".
                for (i, op) in ops.iter().enumerate() {
                    if let Op::Remount = op {
                        continue;
                    }
                    let want = model.apply(&strip(op, prefix));
                    let got = run_op(&fs, op);
                    assert_eq!(got, want, "round {round} thread {t} (seed {seed}) op {i} {op:?}");
                }
            }));
        }
        for h in handles {
            h.join().unwrap();
        }
        fs.unmount().unwrap();
        fsck_clean(&*dev);
    }
}

fn strip(op: &Op, prefix: &str) -> Op {
    let s = |p: &String| p.strip_prefix(prefix).unwrap().to_string();
    match op {
        Op::Create(p) => Op::Create(s(p)),
        Op::Mkdir(p) => Op::Mkdir(s(p)),
        Op::Write(p, a, b, c) => Op::Write(s(p), *a, *b, *c),
        Op::Truncate(p, a) => Op::Truncate(s(p), *a),
        Op::Read(p, a, b) => Op::Read(s(p), *a, *b),
        Op::Stat(p) => Op::Stat(s(p)),
        Op::Unlink(p) => Op::Unlink(s(p)),
        Op::Rmdir(p) => Op::Rmdir(s(p)),
        Op::Link(a, b) => Op::Link(s(a), s(b)),
        Op::Rename(a, b) => Op::Rename(s(a), s(b)),
        Op::Chmod(p, m) => Op::Chmod(s(p), *m),
        Op::SetXattr(p, k, l) => Op::SetXattr(s(p), *k, *l),
        Op::RemoveXattr(p, k) => Op::RemoveXattr(s(p), *k),
        Op::GetXattrs(p) => Op::GetXattrs(s(p)),
        other => other.clone(),
    }
}

/// Readers and writers on the same pages of one file: every read sees whole writes
/// (the per-inode lock orders them) and the final content is the model's.
#[test]
fn shared_file_readers_and_writers() {
    let (dev, fs) = mem_fs(32 * MIB);
    fs.write_file("/shared", &vec![0u8; 64 * 1024]).unwrap();
    let mut handles = Vec::new();
    for t in 0..4u8 {
        let fs = fs.clone();
        handles.push(std::thread::spawn(move || {
            let f = OpenOptions::new().read(true).write(true).open(&fs, "/shared").unwrap();
            let mut buf = vec![0u8; 3000];
            for i in 0..300u32 {
                // Writer t owns bytes [t*16K, (t+1)*16K); it fills a 3000-byte span with one value.
                let off = t as u64 * 16384 + (i as u64 * 997) % (16384 - 3000);
                let v = (i % 250) as u8 + 1;
                f.write_at(&vec![v; 3000], off).unwrap();
                // Any 3000-byte read of a span written whole is uniform or mixes only
                // whole earlier writes: check the span just written reads back.
                f.read_at(&mut buf, off).unwrap();
                assert!(buf.iter().all(|b| *b == v), "thread {t} iteration {i}: read-your-write");
                if i % 50 == 0 {
                    fs.sync().unwrap();
                }
            }
        }));
    }
    for h in handles {
        h.join().unwrap();
    }
    let data = fs.read_file("/shared").unwrap();
    assert_eq!(data.len(), 64 * 1024);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}
