//! NUMA topology from `/sys` and thread binding with `sched_setaffinity`.
//!
//! Owns: node discovery and pinning of the calling thread. Not: memory policy (first touch
//! by a bound thread places pages, so no `mbind` is needed). On a box without
//! `/sys/devices/system/node` (containers, non-Linux) it reports one node holding every CPU the
//! process may run on, so callers never special-case it.
use std::fs;

/// One NUMA node: its id and the CPUs (that this process may use) on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaNode {
    /// Node id as the kernel numbers it.
    pub id: usize,
    /// CPU ids of this node that are in the process affinity mask.
    pub cpus: Vec<usize>,
}

/// Parses a kernel CPU list such as `0-3,8,10-11`.
pub fn parse_cpu_list(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                    out.extend(a..=b);
                }
            }
            None => {
                if let Ok(a) = part.trim().parse() {
                    out.push(a);
                }
            }
        }
    }
    out
}

/// The CPUs this process may run on (its affinity mask), in increasing order.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most sizeof(cpu_set_t) bytes.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect();
            if !cpus.is_empty() {
                return cpus;
            }
        }
    }
    (0..std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1))
        .collect()
}

/// The NUMA nodes that hold at least one allowed CPU (one node when `/sys` says nothing).
pub fn nodes() -> Vec<NumaNode> {
    let allowed = allowed_cpus();
    let mut out = Vec::new();
    if let Ok(online) = fs::read_to_string("/sys/devices/system/node/online") {
        for id in parse_cpu_list(&online) {
            let path = format!("/sys/devices/system/node/node{id}/cpulist");
            if let Ok(list) = fs::read_to_string(path) {
                let cpus: Vec<usize> = parse_cpu_list(&list)
                    .into_iter()
                    .filter(|c| allowed.contains(c))
                    .collect();
                if !cpus.is_empty() {
                    out.push(NumaNode { id, cpus });
                }
            }
        }
    }
    if out.is_empty() {
        out.push(NumaNode {
            id: 0,
            cpus: allowed,
        });
    }
    out
}

/// Binds the calling thread to `cpus`. Returns false (and leaves the thread unbound) on failure.
pub fn bind_current_thread(cpus: &[usize]) -> bool {
    if cpus.is_empty() {
        return false;
    }
    // SAFETY: cpu_set_t is plain data; CPU_SET is bounds-checked against CPU_SETSIZE below and
    // sched_setaffinity reads exactly sizeof(cpu_set_t) bytes.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list(""), Vec::<usize>::new());
    }

    #[test]
    fn at_least_one_node() {
        let n = nodes();
        assert!(!n.is_empty() && !n[0].cpus.is_empty());
    }
}
