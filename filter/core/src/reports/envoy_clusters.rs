//! Reads one cluster's members from Envoy's admin `/clusters?format=json`.
//!
//! A host is healthy when `health_status.eds_health_status` is absent,
//! `HEALTHY` or `UNKNOWN`, and none of the `failed_*` / `pending_*` flags
//! Envoy sets (active health checks, outlier detection, dynamic removal) is
//! true. Unhealthy members stay in the endpoint table but are not routed to.
//!
//! A member's address must be an IP and its port 1–65535; it is written as
//! `SocketAddr` prints it (`10.0.0.7:8000`, `[fd00::7]:8000`), the form the
//! destination header carries and `endpoints.static` accepts. Envoy lists
//! resolved hosts, so anything else (a hostname, a port out of range, a
//! comma, a 64 KiB string the endpoint table could not hold) comes from a
//! broken or hostile admin answer: that host is skipped.

use serde::Deserialize;
use std::fmt;
use std::net::{IpAddr, SocketAddr};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClustersError {
    Json(String),
    /// The cluster is not in the admin output (not configured yet, or misnamed).
    NoSuchCluster(String),
}

impl fmt::Display for ClustersError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClustersError::Json(m) => write!(f, "admin /clusters?format=json did not parse: {m}"),
            ClustersError::NoSuchCluster(c) => write!(f, "cluster \"{c}\" is not in Envoy's /clusters output (check endpoints.fromCluster.cluster)"),
        }
    }
}

impl std::error::Error for ClustersError {}

#[derive(Deserialize)]
struct Clusters {
    #[serde(default)]
    cluster_statuses: Vec<ClusterStatus>,
}

#[derive(Deserialize)]
struct ClusterStatus {
    name: String,
    #[serde(default)]
    host_statuses: Vec<HostStatus>,
}

#[derive(Deserialize)]
struct HostStatus {
    #[serde(default)]
    address: Option<Address>,
    #[serde(default)]
    health_status: Option<serde_json::Map<String, serde_json::Value>>,
}

#[derive(Deserialize)]
struct Address {
    #[serde(default)]
    socket_address: Option<SocketAddress>,
}

#[derive(Deserialize)]
struct SocketAddress {
    address: String,
    #[serde(default)]
    port_value: u32,
}

/// The members of `cluster` as (`ip:port`, healthy).
pub fn cluster_members(json: &[u8], cluster: &str) -> Result<Vec<(String, bool)>, ClustersError> {
    let c: Clusters =
        serde_json::from_slice(json).map_err(|e| ClustersError::Json(e.to_string()))?;
    let status = c
        .cluster_statuses
        .into_iter()
        .find(|s| s.name == cluster)
        .ok_or_else(|| ClustersError::NoSuchCluster(cluster.to_string()))?;
    let mut out = Vec::with_capacity(status.host_statuses.len());
    for h in status.host_statuses {
        let Some(sa) = h.address.and_then(|a| a.socket_address) else {
            continue;
        };
        let Some(addr) = member_address(&sa) else {
            continue;
        };
        let healthy = h.health_status.as_ref().is_none_or(|hs| {
            let eds_ok = match hs.get("eds_health_status").and_then(|v| v.as_str()) {
                None | Some("HEALTHY") | Some("UNKNOWN") => true,
                Some(_) => false,
            };
            let flagged = hs.iter().any(|(k, v)| {
                (k.starts_with("failed_") || k.starts_with("pending_")) && v.as_bool() == Some(true)
            });
            eds_ok && !flagged
        });
        out.push((addr, healthy));
    }
    Ok(out)
}

/// `ip:port` of a resolved host; `None` unless the address is an IP and
/// the port is 1–65535.
fn member_address(sa: &SocketAddress) -> Option<String> {
    let ip: IpAddr = sa.address.parse().ok()?;
    let port = u16::try_from(sa.port_value).ok().filter(|&p| p != 0)?;
    Some(SocketAddr::new(ip, port).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_and_health() {
        let j = br#"{"cluster_statuses":[{"name":"other","host_statuses":[]},
          {"name":"vllm","host_statuses":[
            {"address":{"socket_address":{"address":"127.0.0.1","port_value":18001}},"health_status":{"eds_health_status":"HEALTHY"},"weight":1},
            {"address":{"socket_address":{"address":"127.0.0.1","port_value":18002}},"health_status":{"eds_health_status":"HEALTHY","failed_active_health_check":true}},
            {"address":{"socket_address":{"address":"::1","port_value":18003}},"health_status":{"eds_health_status":"UNHEALTHY"}},
            {"address":{"pipe":{"path":"/x"}}}
          ]}]}"#;
        assert_eq!(
            cluster_members(j, "vllm").unwrap(),
            vec![
                ("127.0.0.1:18001".into(), true),
                ("127.0.0.1:18002".into(), false),
                ("[::1]:18003".into(), false)
            ]
        );
        assert_eq!(
            cluster_members(j, "nope"),
            Err(ClustersError::NoSuchCluster("nope".into()))
        );
        assert!(matches!(
            cluster_members(b"{", "vllm"),
            Err(ClustersError::Json(_))
        ));
    }

    /// Only resolved `ip:port` hosts become members. Found writing the
    /// `envoy_clusters` fuzz target (its invariant: every member is an
    /// `ip:port`): a hostname or a comma went into the endpoint table and
    /// the destination header as is, and an address over 64 KiB would be
    /// cut by the table's u16 length (here inside a UTF-8 character), so
    /// `kvroute/endpoints` would no longer decode.
    #[test]
    fn hosts_that_are_not_ip_port_are_skipped() {
        let host = |addr: &str, port: u64| {
            format!(
                r#"{{"address":{{"socket_address":{{"address":{addr:?},"port_value":{port}}}}}}}"#
            )
        };
        let long = "é".repeat(40_000);
        let hosts = [
            host("10.0.0.1", 8000),
            host("10.0.0.2,10.0.0.3", 8000),
            host("vllm.default.svc", 8000),
            host("10.0.0.4", 0),
            host("10.0.0.5", 65_536),
            host(&long, 8000),
            host("fd00:0::7", 8000),
            host("10.0.0.6", 65_535),
        ];
        let j = format!(
            r#"{{"cluster_statuses":[{{"name":"vllm","host_statuses":[{}]}}]}}"#,
            hosts.join(",")
        );
        assert_eq!(
            cluster_members(j.as_bytes(), "vllm").unwrap(),
            vec![
                ("10.0.0.1:8000".into(), true),
                ("[fd00::7]:8000".into(), true),
                ("10.0.0.6:65535".into(), true),
            ]
        );
    }
}
