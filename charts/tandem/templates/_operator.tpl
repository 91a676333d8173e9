{{/*
How the chart starts `tandem operator`: its arguments, settings and liveness endpoint.
Kept in one place; they follow docs/operator.md ("Running it").
*/}}

{{- define "tandem.operatorHealthPort" -}}8080{{- end -}}
{{- define "tandem.operatorHealthPath" -}}/healthz{{- end -}}

{{/* The operator's own /metrics port; 0 = not served (the schema keeps it off the liveness port). */}}
{{- define "tandem.operatorMetricsPort" -}}
{{- ternary .Values.operator.metrics.port 0 .Values.operator.metrics.enabled -}}
{{- end -}}

{{/* The leader Lease, in the release namespace: the replica holding it acts, the others wait. */}}
{{- define "tandem.leaseName" -}}{{ include "tandem.operatorName" . }}{{- end -}}

{{- define "tandem.operatorEnv" -}}
- name: TANDEM_OPERATOR_NAMESPACES
  value: {{ join "," .Values.operator.watchNamespaces | quote }}
- name: TANDEM_OPERATOR_LEADER_ELECTION
  value: "true"
- name: TANDEM_OPERATOR_LEADER_ELECTION_LEASE
  value: {{ include "tandem.leaseName" . | quote }}
- name: TANDEM_OPERATOR_LEADER_ELECTION_NAMESPACE
  value: {{ .Release.Namespace | quote }}
- name: TANDEM_OPERATOR_LEADER_ELECTION_IDENTITY
  value: $(POD_NAME)
- name: TANDEM_OPERATOR_LIVENESS_PORT
  value: {{ include "tandem.operatorHealthPort" . | quote }}
- name: TANDEM_OPERATOR_PROMETHEUS_PORT
  value: {{ include "tandem.operatorMetricsPort" . | quote }}
- name: TANDEM_OPERATOR_LOG_LEVEL
  value: {{ .Values.operator.logLevel | quote }}
{{- end -}}
