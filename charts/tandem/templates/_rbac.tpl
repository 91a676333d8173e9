{{/*
Least-privilege rules of `tandem operator`: exactly the table of docs/operator.md, "Permissions",
each verb one the code calls. watchNamespaces holds exact names only (the schema refuses globs),
so no namespaces rule is needed.
*/}}

{{/* Rules for the namespaces the operator serves: ModelServers and the objects it owns. */}}
{{- define "tandem.rbac.namespacedRules" -}}
# ModelServers: kopf lists and watches them and keeps its progress annotations (patch), which
# also takes off the finalizer of earlier versions; the scaling loop writes their status.
- apiGroups: [tandem.dev]
  resources: [modelservers]
  verbs: [list, watch, patch]
- apiGroups: [tandem.dev]
  resources: [modelservers/status]
  verbs: [patch]
# What a ModelServer owns: read (is it ours?), created, updated on spec changes. Never deleted
# by the operator: the garbage collector follows the owner references.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, create, patch]
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch]
# Ready pods and their addresses, to read each pod's /metrics.
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
# One Event per scaling decision and per problem (and kopf's warnings).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* Cluster-scoped reads kopf needs in every mode: it lists and watches CRDs for its resources. */}}
{{- define "tandem.rbac.clusterRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end -}}

{{/* Leader election, in the release namespace: the one Lease (create cannot name it). */}}
{{- define "tandem.rbac.leaseRules" -}}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  resourceNames: [{{ include "tandem.leaseName" . }}]
  verbs: [get, update]
{{- end -}}
