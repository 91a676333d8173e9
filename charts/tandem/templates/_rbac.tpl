{{/*
Least-privilege rules of `tandem operator`: exactly the table of docs/operator.md, "Permissions".
watchNamespaces holds exact names only (the schema refuses globs), so no namespaces rule is needed.
*/}}

{{/* Rules for the namespaces the operator serves: ModelServers and the objects it owns. */}}
{{- define "tandem.rbac.namespacedRules" -}}
# ModelServers: watch them, keep kopf's finalizer and progress annotations, write their status.
- apiGroups: [tandem.dev]
  resources: [modelservers]
  verbs: [get, list, watch, patch]
- apiGroups: [tandem.dev]
  resources: [modelservers/status]
  verbs: [get, patch]
# What a ModelServer owns: created, updated on spec changes, deleted with it.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
# Ready pods and their addresses, to read each pod's /metrics.
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
# One Event per scaling decision (and kopf's handler events).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{- define "tandem.rbac.namespacedPeeringRules" -}}
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end -}}

{{/* Cluster-scoped reads kopf needs in every mode: discovering its resources from the CRDs. */}}
{{- define "tandem.rbac.clusterRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
{{- end -}}

{{- define "tandem.rbac.clusterPeeringRules" -}}
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [get, list, watch, patch]
{{- end -}}
