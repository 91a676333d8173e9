{{/* Names and labels shared by every template. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tandem.operatorName" -}}
{{- printf "%s-operator" (include "tandem.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "tandem.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "tandem.operatorLabels" -}}
{{ include "tandem.labels" . }}
{{ include "tandem.operatorSelectorLabels" . }}
{{- end -}}

{{/* Labels of objects that are not the operator (example, monitors, dashboard, test). */}}
{{- define "tandem.componentLabels" -}}
{{ include "tandem.labels" .root }}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* image reference: repository[:tag][@digest]; the tag defaults to the chart's appVersion. */}}
{{- define "tandem.image" -}}
{{- $ref := printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- if .image.digest -}}
{{- $ref = printf "%s@%s" $ref .image.digest -}}
{{- end -}}
{{- $ref -}}
{{- end -}}

{{/* True (non-empty) when the operator watches every namespace: cluster-scoped RBAC and peering. */}}
{{- define "tandem.clusterWide" -}}
{{- if not .Values.operator.watchNamespaces -}}true{{- end -}}
{{- end -}}

{{- define "tandem.otelEnv" -}}
{{- if .root.Values.otel.enabled }}
- name: OTEL_SERVICE_NAME
  value: {{ .serviceName | quote }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .root.Values.otel.endpoint | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .root.Values.otel.tracesSampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .root.Values.otel.tracesSamplerArg | quote }}
{{- with .root.Values.otel.resourceAttributes }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ include "tandem.keyValues" . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* a map as k1=v1,k2=v2 in key order (the OTEL_RESOURCE_ATTRIBUTES format) */}}
{{- define "tandem.keyValues" -}}
{{- $pairs := list -}}
{{- range $k, $v := . -}}
{{- $pairs = append $pairs (printf "%s=%v" $k $v) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* Where model-server pods run: every namespace, or the watched ones (a namespaceSelector). */}}
{{- define "tandem.serverNamespaceSelector" -}}
{{- if include "tandem.clusterWide" . -}}
any: true
{{- else -}}
matchNames:
  {{- toYaml .Values.operator.watchNamespaces | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* The field names of ModelServer.spec in the chart's own CRD (a YAML list). */}}
{{- define "tandem.modelServerSpecFields" -}}
{{- $crd := .Files.Get "crds/modelservers.tandem.dev.yaml" | fromYaml -}}
{{- $version := first $crd.spec.versions -}}
{{- keys $version.schema.openAPIV3Schema.properties.spec.properties | sortAlpha | toYaml -}}
{{- end -}}

{{/* The example's health-check address: the plaintext health port once its gRPC port speaks TLS. */}}
{{- define "tandem.exampleHealthTarget" -}}
{{- $port := ternary 50052 50051 (not (empty .Values.exampleModelServer.tls.secretName)) -}}
{{- printf "%s.%s.svc:%d" .Values.exampleModelServer.name .Release.Namespace $port -}}
{{- end -}}
